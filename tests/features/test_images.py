"""Images for the trackers (dmltrain/features/images.py): what ``log_image`` takes and the
one-line refusals. Their way to TensorBoard and wandb is tested in test_tracking."""

import matplotlib
import numpy as np
import pytest
import torch

from dmltrain.errors import UserError
from dmltrain.features import images

matplotlib.use("Agg")
pytestmark = pytest.mark.quick


def test_arrays_become_hwc_uint8_and_a_figure_passes_as_it_is():
    grey = images.checked("f", torch.tensor([[0.0, 0.5], [1.0, 0.25]]))
    assert grey.dtype == np.uint8 and grey.shape == (2, 2, 1)
    assert grey[:, :, 0].tolist() == [[0, 128], [255, 64]]
    rgb = images.checked("f", torch.rand(3, 5, 7))  # CHW
    assert rgb.shape == (5, 7, 3)
    hwc = np.zeros((5, 7, 4), dtype=np.uint8)
    assert images.checked("f", hwc) is hwc
    from matplotlib import pyplot

    figure = pyplot.figure()
    assert images.checked("f", figure) is figure
    pyplot.close(figure)


@pytest.mark.parametrize(
    ("image", "line"),
    [
        (torch.randn(4, 4) * 3 + 10, "log_image('map'): its values run from "),
        (torch.zeros(2, 3, 5, 5), "log_image('map'): shape (2, 3, 5, 5) is not an image; "),
        (torch.zeros(4, 4, dtype=torch.int64), "log_image('map'): give uint8 or floats in "),
        ([[0.0, 1.0]], "log_image('map'): a list is not an image; give a tensor or array"),
    ],
    ids=["out of range", "a batch", "integers", "a list"],
)
def test_what_is_not_an_image_is_one_line(image, line):
    with pytest.raises(UserError) as caught:
        images.checked("map", image)
    assert str(caught.value).startswith(line) and "\n" not in str(caught.value)

"""Images for the trackers (``BaseTrainer.log_image``): checked where the experiment hands
them over, so a bad one is the experiment's one-line error rather than a tracker that
turns itself off.

An image is a tensor or array, HW (grey) or CHW/HWC with 1, 3 or 4 channels, of uint8 or
of floats in [0, 1]; or a matplotlib ``Figure`` (a field with a colour bar, a scatter
plot). Arrays become HWC uint8 numpy arrays, which TensorBoard and wandb take as they are.
"""

from typing import Any

import numpy as np
import torch

from dmltrain.errors import UserError

CHANNELS = (1, 3, 4)


def is_figure(image: Any) -> bool:
    return type(image).__name__ == "Figure" and hasattr(image, "savefig")


def checked(name: str, image: Any) -> Any:
    """``image`` as the trackers take it: a Figure as it is, an array as HWC uint8."""
    if is_figure(image):
        return image
    if isinstance(image, torch.Tensor):
        image = (
            image.detach().float().cpu().numpy()
            if image.is_floating_point()
            else (image.detach().cpu().numpy())
        )
    if not isinstance(image, np.ndarray):
        raise UserError(
            f"log_image({name!r}): a {type(image).__name__} is not an image; give a tensor or "
            "array (HW, CHW or HWC) or a matplotlib Figure"
        )
    if image.ndim == 3 and image.shape[0] in CHANNELS and image.shape[-1] not in CHANNELS:
        image = image.transpose(1, 2, 0)
    if image.ndim == 2:
        image = image[:, :, None]
    if image.ndim != 3 or image.shape[-1] not in CHANNELS:
        raise UserError(
            f"log_image({name!r}): shape {image.shape} is not an image; give HW, or CHW or "
            "HWC with 1, 3 or 4 channels"
        )
    if image.dtype == np.uint8:
        return image
    if not np.issubdtype(image.dtype, np.floating):
        raise UserError(f"log_image({name!r}): give uint8 or floats in [0, 1], not {image.dtype}")
    low, high = float(np.nanmin(image)), float(np.nanmax(image))
    if not (low >= 0.0 and high <= 1.0):
        raise UserError(
            f"log_image({name!r}): its values run from {low:.4g} to {high:.4g}; floats must lie "
            "in [0, 1]: scale them, or draw the field as a matplotlib Figure with a colour bar"
        )
    return np.round(np.nan_to_num(image) * 255).astype(np.uint8)

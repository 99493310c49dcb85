"""``import torchvision`` on this project's CPU build of torch.

PyPI's torchvision wheels are built against CUDA builds of torch: beside a CPU build their
compiled ops do not load, and torchvision's import then fails registering two of them
(``operator torchvision::nms does not exist``). The ports and their scripts use none of
its compiled ops (datasets, transforms, models, ``save_image``), so where the import fails
so, the two ops' schemas are declared and torchvision imported again: its Python parts
work, and a compiled op raises torchvision's own "Couldn't load custom C++ ops".

Installed beside the CPU build, such a torchvision breaks every import of it, torchmetrics'
among them: tests/run.sh installs it in build/torchvision, which tests/test_ports.py puts
on the path of the scripts and ports alone."""

import sys

import torch

_LIBRARIES: list[torch.library.Library] = []  # kept: a Library's definitions go with it


def torchvision():
    try:
        import torchvision
    except RuntimeError as exc:
        if "torchvision::nms does not exist" not in str(exc):
            raise
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        library = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIBRARIES.append(library)
        import torchvision
    return torchvision

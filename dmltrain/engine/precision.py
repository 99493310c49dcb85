"""Numeric precision, chosen once: ``--precision {fp32,fp16,bf16}``.

``Precision`` owns autocast, the fp16 grad scaler and its state; the loop calls the same
methods whatever the choice. fp16 uses ``torch.amp.GradScaler`` (on CUDA, and on the CPU
where this torch supports it); bf16 needs no scaler. A step the scaler drops because the
scaled gradients overflowed is normal in fp16: it is counted (on the device, no sync) and
reported as ``skipped_steps``, not treated as a NaN.
"""

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from dmltrain import compat
from dmltrain.errors import UserError, first_line

T = TypeVar("T")

DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def check_available(kind: str, device: torch.device) -> None:
    """A UserError naming what to use instead, if ``kind`` cannot run on ``device``."""
    dtype = DTYPES[kind]
    if dtype is None:
        return
    if device.type == "cuda":
        if kind == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
            name = torch.cuda.get_device_name(device)
            raise UserError(
                f"--precision bf16 needs a GPU with bfloat16 support (compute capability "
                f"8.0 or newer); {name} has none: use --precision fp16"
            )
        return
    try:
        with torch.autocast(device.type, dtype=dtype):
            torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        if kind == "fp16":
            torch.amp.GradScaler(device.type)
    except Exception as exc:
        other = "bf16 or fp32" if kind == "fp16" else "fp32"
        raise UserError(
            f"--precision {kind} is not available on {device.type} with torch "
            f"{torch.__version__} ({first_line(exc, 120)}); use --precision {other}"
        ) from None


def set_matmul_precision(kind: str, device: torch.device) -> None:
    """fp32 matrix products on a GPU: TF32 allowed (``high``) or not (``highest``). A
    process-wide torch setting, left alone on the CPU (whose results tests compare bit for
    bit)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision(kind)


class Precision:
    """Autocast, loss scaling and the scaler's state for one precision on one device."""

    def __init__(self, kind: str, device: torch.device) -> None:
        check_available(kind, device)
        self.device = device
        self.dtype: torch.dtype | None = DTYPES[kind]
        self.scaler = torch.amp.GradScaler(device.type) if kind == "fp16" else None
        # no autocast and no scaler: forward, backward and step are the plain calls, which a
        # step may make itself (dmltrain.engine.step), one call fewer each
        self.plain = self.dtype is None and self.scaler is None
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # overflow steps

    def forward(self, fn: Callable[[Any], T], batch: Any) -> T:
        """``fn(batch)`` under autocast (backward runs outside it, as torch advises);
        in fp32 a plain call: no context to enter at every step."""
        if self.dtype is None:
            return fn(batch)
        with torch.autocast(self.device.type, dtype=self.dtype):
            return fn(batch)

    def backward(self, loss: Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients back to their true values (before clipping or checking them)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step; with a scaler, skipped (and counted) if gradients overflowed."""
        if self.scaler is None:
            optimizer.step()
            return
        self.apply(optimizer)
        self.update()

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer's update of a step that may have several (``update`` once after
        them all); with a scaler, skipped if its gradients overflowed."""
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)

    def update(self) -> None:
        """After a step's updates: the scaler's new scale; a step it skipped is counted."""
        if self.scaler is None:
            return
        # GradScaler keeps its scale as a device tensor; comparing it before and after the
        # update tells an overflow step without a host sync.
        before = compat.scaler_scale(self.scaler).clone()
        self.scaler.update()
        self.skipped += compat.scaler_scale(self.scaler) < before

    @property
    def scale(self) -> Tensor | None:
        """The current loss scale (a device tensor), or None without a scaler."""
        return None if self.scaler is None else compat.scaler_scale(self.scaler)

    def state_dict(self) -> dict[str, Any] | None:
        if self.scaler is None:
            return None
        return {"scaler": self.scaler.state_dict(), "skipped": int(self.skipped)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is None or state is None:
            return
        self.scaler.load_state_dict(state["scaler"])
        self.skipped.fill_(state["skipped"])

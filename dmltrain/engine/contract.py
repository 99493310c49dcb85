"""The experiment's contract: what its methods must return, checked where a break first
shows, so the user reads which method returned what and what it must return instead of
an error from deep inside torch. The training step's checks cost nothing while the
contract holds: they run only once torch has raised."""

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dmltrain.errors import UserError


def datasets(result: Any) -> tuple[Any, Any]:
    """``create_datasets()``'s (train, validation or None)."""
    if isinstance(result, tuple | list) and len(result) == 2:
        return result[0], result[1]
    got = f"a {type(result).__name__}" + (
        f" of {len(result)}" if isinstance(result, tuple | list) else ""
    )
    raise UserError(
        f"create_datasets must return (train dataset, validation dataset or None); it "
        f"returned {got}"
    )


def model(module: Any) -> None:
    """``create_model()``'s module, with something to train."""
    if not isinstance(module, nn.Module):
        raise UserError(
            f"create_model must return a torch.nn.Module; it returned a {type(module).__name__}"
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise UserError(
            f"create_model returned a {type(module).__name__} with no trainable parameters; "
            "give it layers with parameters (or unfreeze them)"
        )


def several(result: Any, method: str) -> tuple[Any, ...]:
    """``create_optimizer()``'s or ``create_scheduler()``'s one object or list of them."""
    items = tuple(result) if isinstance(result, tuple | list) else (result,)
    if not items:
        raise UserError(f"{method} returned an empty {type(result).__name__}; return one or more")
    scheduler = method == "create_scheduler"
    for item in items:
        if scheduler:
            ok = all(callable(getattr(item, name, None)) for name in ("step", "state_dict"))
        else:  # checked before the strategy wraps it
            ok = isinstance(item, torch.optim.Optimizer)
        if not ok:
            what = "an LR scheduler" if scheduler else "a torch.optim.Optimizer"
            raise UserError(
                f"{method} must return {what} or a list of them; it returned a "
                f"{type(item).__name__}"
            )
    return items


def loss(output: Any, exc: BaseException) -> UserError | None:
    """Why the backward of ``train_step``'s loss failed, when the loss is the cause."""
    what = "train_step must return the loss (a scalar tensor) or (loss, dict of metrics)"
    if not isinstance(output, Tensor):
        return UserError(f"{what}; it returned a {type(output).__name__} as the loss")
    if output.dim() != 0:
        return UserError(
            f"{what}; its loss has shape {tuple(output.shape)}: reduce it to one number "
            "(e.g. .mean())"
        )
    if not output.requires_grad:
        return UserError(
            f"{what}; its loss does not require grad: compute it from the model's output, "
            "not under torch.no_grad() or from .detach()/.item()"
        )
    return None


def step_metrics(values: Any, method: str) -> Mapping[str, Any]:
    """``val_step``/``test_step``'s metrics of a batch."""
    if not isinstance(values, Mapping):
        raise UserError(
            f"{method} must return a dict of metrics (e.g. {{'loss': loss}}); it returned a "
            f"{type(values).__name__}"
        )
    return values


def data(exc: BaseException) -> UserError | None:
    """A batch that cannot be made because the samples differ (torch's default collate)."""
    text = str(exc)
    if "stack expects each tensor to be equal size" in text:
        detail = text[text.index("stack expects") :].splitlines()[0]
        return UserError(
            f"the dataset's samples differ in shape ({detail}): make them equal, or pass "
            "create_dataloader a collate_fn that pads them"
        )
    return None


def steps_without_closure(optimizers: Sequence[Any]) -> None:
    """The automatic step calls ``optimizer.step()``; one whose step needs a closure (LBFGS
    evaluates the loss several times a step) is refused here, with what to do instead."""
    for optimizer in optimizers:
        try:
            closure = inspect.signature(optimizer.step).parameters.get("closure")
        except (TypeError, ValueError):  # a step inspect cannot read: tried as it is
            continue
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise UserError(
                f"{type(optimizer).__name__}.step needs a closure (it evaluates the loss "
                "several times a step): set manual_optimization = True and call "
                "self.optimizer_step(optimizer, closure) in train_step"
            )

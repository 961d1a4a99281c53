"""Backward hooks: functions that see, and may replace, the gradient that reaches a hook point.

A backward hook is `fn(grad, hook) -> None | tensor`, TransformerLens's `dir="bwd"`: `grad` is the gradient of
whatever is differentiated with respect to the hook point's output, that is at the value its forward hooks left
there, with the same shape. A returned tensor replaces that gradient for everything upstream of the point.

They are attached during the forward: a hook point that has backward hooks registers one tensor hook on the tensor
it outputs (none under `torch.no_grad()`, or when nothing upstream needs a gradient). Like forward hooks they belong
to the calling context (`model.hooks(bwd_hooks=...)`) or are global (`model.add_hook(name, fn, dir="bwd")`). Each
attachment is checked again when the gradient arrives, so a backward run after its `with` block exited, or after
`reset_hooks()` removed it, calls nothing: build the loss and call `.backward()` inside the block.

One tensor can be the output of two hook points (`resid_post` of block l is `resid_pre` of block l + 1); its
tensor hook runs the later point's hooks first, as the gradient meets them going backward.
"""

from __future__ import annotations

import torch
from torch import nn

from .hook_context import HookFn  # hook points appear as nn.Module: lenskit.observe.hooks imports this module


class Attachment:
    """One backward hook attached once; `live` turns False when its `with` block exits or it is removed."""

    __slots__ = ("fn", "live")

    def __init__(self, fn: HookFn) -> None:
        self.fn = fn
        self.live = True


def attach_backward(hp: nn.Module, x: torch.Tensor, global_hooks: list[Attachment],
                    local: dict[nn.Module, tuple[Attachment, ...]] | None) -> torch.Tensor:
    """Register the backward hooks of `hp` (its global ones, then the calling context's, `local`:
    lenskit.observe.hook_context) on its output `x`; returns x."""
    attached = (*global_hooks, *(local.get(hp, ()) if local else ()))
    if not attached or not x.requires_grad:
        return x  # no gradient will arrive here
    chain = getattr(x, "_lenskit_backward", None)
    if chain is None:
        chain = []
        x._lenskit_backward = chain  # type: ignore[attr-defined]
        x.register_hook(lambda grad: _run(chain, grad))
    chain.insert(0, (hp, attached))  # a later hook point on the same tensor is met first going backward
    return x


def _run(chain: list[tuple[nn.Module, tuple[Attachment, ...]]], grad: torch.Tensor) -> torch.Tensor:
    for hp, attached in chain:
        for a in attached:
            if a.live:
                out = a.fn(grad, hp)
                if out is not None:
                    grad = _checked(hp, a.fn, out, grad)
    return grad


def _checked(hp: nn.Module, fn: HookFn, out: object, grad: torch.Tensor) -> torch.Tensor:
    if isinstance(out, tuple) and len(out) == 1:
        out = out[0]  # torch's module backward hooks return a tuple of gradients, and TransformerLens's hooks are those
    if not isinstance(out, torch.Tensor) or out.shape != grad.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"backward hook {getattr(fn, '__qualname__', fn)!s:.60} on {hp.name} returned {got}; expected "
                         f"None or a gradient of shape {tuple(grad.shape)}")
    if out.dtype != grad.dtype or out.device != grad.device:
        raise TypeError(f"backward hook on {hp.name} returned a {out.dtype} tensor on {out.device}, but the gradient is "
                        f"{grad.dtype} on {grad.device}; return it with .to(grad)")
    return out


def check_gradients_possible(what: str) -> None:
    """RuntimeError, in one line, inside `torch.inference_mode()`: no graph is recorded there and `enable_grad` cannot
    turn it back on, so `what` (a backward pass, a gradient) would fail later with a message about something else."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(f"{what} needs gradients, which torch.inference_mode() turns off (torch.enable_grad cannot "
                           "undo it); call it outside the inference_mode block")


def backward_from(out: object, hint: str = "") -> None:
    """`.backward()` on a forward's output for `incl_bwd=True`, refusing, in one line, one that is not a scalar with a
    gradient (`hint` says how to get one)."""
    if not (isinstance(out, torch.Tensor) and out.ndim == 0 and out.requires_grad):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"incl_bwd=True calls .backward() on the forward's output, which must be a scalar with a "
                         f"gradient{hint}; got {got}")
    out.backward()


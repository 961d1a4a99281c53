"""Normalisation pieces: LayerNorm, RMSNorm and Gemma's (1 + w) RMSNorm, each written out, chosen once by `make_norm`;
and Gemma 4's value norm, an RMSNorm with no gain (`UnitRMSNorm`).

Both expose `hook_scale` ([..., 1], the divisor) and `hook_normalized` (the output). The output is the fused kernel's
unless a hook on `hook_scale` changes the scale (returns a tensor, edits it in place) or is a backward hook, which
needs the scale in the graph: then it is computed from the hooked scale, the same function rounded differently (in
bf16 by up to a few 1e-3). So hooks that only read, on either point, leave every number as an unhooked run gives it,
and `hook_normalized` always sees exactly what flows on. After `fold_ln`
(lenskit.processing) a norm's weight is at its identity and LayerNorm's bias is zero, so `hook_normalized` is the
pure normalisation, TransformerLens's meaning: (x - mean) / scale for LayerNorm, x / scale for RMSNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias, statistics over the last axis only."""

    IDENTITY_WEIGHT = 1.0  # the weight value that leaves the normalised vector unscaled

    @classmethod
    def processing_refusal(cls, cfg: ModelConfig, option: str) -> tuple[str, bool] | None:
        """None: every weight-processing option applies exactly under LayerNorm (lenskit.processing)."""
        return None

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.hook_scale.has_hooks() or self.hook_normalized.has_hooks()):
            # The fused kernel is what transformers runs; same maths, fewer passes over memory.
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        centred = x - x.mean(-1, keepdim=True)
        scale = _changed(self.hook_scale, (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())  # [batch, pos, 1]
        if scale is None:  # the hooks on it only read: the kernel's numbers stand
            return self.hook_normalized(F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps))
        return self.hook_normalized(centred / scale * self.weight + self.bias)

    def written_out(self, x: torch.Tensor) -> torch.Tensor:
        """The forward step by step, through the hooks, whatever they do (TransformerLens's norms always run this
        way; the namespace's model uses it so that caching a norm moves no number)."""
        x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())  # [batch, pos, 1]
        return self.hook_normalized(x / scale * self.weight + self.bias)

    @property
    def gain(self) -> torch.Tensor:
        """The per-feature multiplier applied after dividing by the scale."""
        return self.weight


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight: no centring and no bias. Also the per-head q/k norm
    (Qwen 3), where the last axis is d_head and the hooks see [batch, pos, head, ...]."""

    IDENTITY_WEIGHT = 1.0

    @classmethod
    def processing_refusal(cls, cfg: ModelConfig, option: str) -> tuple[str, bool] | None:
        """center_writing_weights needs a norm that removes the stream's mean (lenskit.processing): this one does not,
        so centring would change the model; TransformerLens skips it."""
        if option == "center_writing_weights":
            return (f"center_writing_weights needs LayerNorm, which removes the stream's mean; {cfg.family} uses "
                    f"{cfg.norm}, so it would change the model (TransformerLens skips it there); pass "
                    "center_writing_weights=False", True)
        return None

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.hook_scale.has_hooks() or self.hook_normalized.has_hooks()):
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        scale = _changed(self.hook_scale, (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())  # [batch, pos, 1]
        if scale is None:
            return self.hook_normalized(F.rms_norm(x, x.shape[-1:], self.weight, self.eps))
        return self.hook_normalized(x / scale * self.weight)

    def written_out(self, x: torch.Tensor) -> torch.Tensor:
        """The forward step by step, through the hooks, whatever they do (see `LayerNorm.written_out`)."""
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())  # [batch, pos, 1]
        return self.hook_normalized(x / scale * self.weight)

    @property
    def gain(self) -> torch.Tensor:
        return self.weight


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + weight), computed in float32 and cast back to the
    input's dtype at the end (as transformers does; in bf16 this rounds once, not twice). A zero weight
    is the identity gain, so `init_weights` zeroes it."""

    IDENTITY_WEIGHT = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if not (self.hook_scale.has_hooks() or self.hook_normalized.has_hooks()):
            return self._fused(xf).type_as(x)
        scale = _changed(self.hook_scale, (xf.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())  # [batch, pos, 1]
        if scale is None:
            return self.hook_normalized(self._fused(xf).type_as(x))
        return self.hook_normalized((xf / scale * (1.0 + self.weight.float())).type_as(x))

    def _fused(self, xf: torch.Tensor) -> torch.Tensor:
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())

    @property
    def gain(self) -> torch.Tensor:
        return 1.0 + self.weight


class UnitRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) with no gain, in float32 and cast back (Gemma 4's value norm). It has no weight to
    fold, so `lenskit.processing` leaves it alone."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.hook_scale = HookPoint()  # [batch, pos, head, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, head, d_head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        scale = self.hook_scale((xf.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())  # [..., 1]
        return self.hook_normalized((xf / scale).type_as(x))


def _changed(hook_scale: HookPoint, scale: torch.Tensor) -> torch.Tensor | None:
    """`scale` [..., 1] through the hooks on `hook_scale`: what they left there, or None where they only read it
    (returned nothing, changed no value in place, no backward hook), so that the fused kernel's output stands."""
    if not hook_scale.has_hooks():
        return None
    before = scale.clone()  # to see an edit in place (inference tensors count no writes, so values are compared)
    hooked = hook_scale(scale)
    if hooked is scale and torch.equal(scale, before) and not hook_scale.has_hooks("bwd"):
        return None
    return hooked


NORM_CLASSES = {"layernorm": LayerNorm, "rmsnorm": RMSNorm, "rmsnorm_offset": OffsetRMSNorm}


def norm_params(cfg: ModelConfig, size: int | None = None) -> tuple[int, int]:
    """One of the family's norms over `size` features (d_model unless given), as (weights, biases): its gain, and its
    shift where it is a LayerNorm (lenskit.accounting counts gains as weights, shifts as biases)."""
    n = cfg.d_model if size is None else size
    return n, n if NORM_CLASSES[cfg.norm] is LayerNorm else 0


def make_norm(cfg: ModelConfig, size: int | None = None) -> nn.Module:
    """The family's norm over `size` features (d_model unless given, e.g. d_head for q/k norms)."""
    return NORM_CLASSES[cfg.norm](cfg.d_model if size is None else size, cfg.norm_eps)

"""The model's readout: final norm, unembedding, then any final logit soft-cap. Written once, here.

Everything that turns a residual vector into next-token logits goes through `Readout`: the model's own
forward, every lens, the tuned-lens training step, evaluation and direct logit attribution. A change to
the readout (a new family's cap, a bias) is one edit.

>>> h = cache["resid_post", 5]        # the last block's output: [batch, pos, d_model]
>>> torch.allclose(model.readout(h), logits, atol=1e-4)   # logits [..., d_vocab], as the model computes them
True
>>> torch.equal(model.readout.uncapped(h), model.readout(h))   # before the soft-cap; GPT-2 has none
True
>>> out = torch.empty(13, model.cfg.d_vocab)
>>> with torch.no_grad():              # float32 logits written into a reused [rows, d_vocab] buffer
...     written = model.readout.into(h[0], out)
>>> written.data_ptr() == out.data_ptr() and torch.allclose(out, logits[0], atol=1e-4)
True
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .linear import linear, linear_into


class Readout:
    """`cap(unembed(norm(h)))`, with the norm's scale computed on this `h`. The unembedding's output is the logits,
    times the family's constant `scale` where it has one (`cfg.scales.logits`, Granite's 1 / logits_scaling; 1
    elsewhere, `pieces.embeddings.Unembed`); the paths here that multiply by its weight themselves apply it too.

    It holds the model's own `ln_final` and `unembed` modules (not copies), so moving or editing the
    model moves and edits its readout. `softcap` is the final logit cap c (logits = c tanh(z / c)) or None.
    Its input moves to the unembedding's device first (a no-op on one device), so a stream read on any block's
    device under a device map is read out where the readout lives.
    """

    @classmethod
    def processing_refusal(cls, cfg: ModelConfig, option: str) -> tuple[str, bool] | None:
        """center_unembed shifts every logit at a position alike, which a final soft-cap does not ignore
        (lenskit.processing)."""
        if option == "center_unembed" and cfg.final_softcap is not None:
            return (f"center_unembed would change {cfg.family}'s probabilities: its final soft-cap "
                    f"c*tanh(z/c) (c={cfg.final_softcap}) is not shift-invariant; pass center_unembed=False", False)
        return None

    def __init__(self, norm: nn.Module, unembed: nn.Linear, softcap: float | None) -> None:
        self.norm, self.unembed, self.softcap = norm, unembed, softcap

    @property
    def scale(self) -> float:
        """The logits' constant multiplier, the unembedding's (1 where it has none)."""
        return getattr(self.unembed, "scale", 1.0)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d_model] -> logits [..., d_vocab] in the model's dtype."""
        return self.cap_(self.uncapped(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """What lenses hand back: h cast to the model's dtype, read out, and half-precision logits upcast to
        float32 for the metrics' log-softmax."""
        logits = self(h if h.dtype == self.unembed.weight.dtype else h.to(self.unembed.weight.dtype))
        return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits

    def uncapped(self, h: torch.Tensor) -> torch.Tensor:
        """The logits before any final soft-cap (the same as calling the readout for a model without one)."""
        return self.unembed(self.norm(h.to(self.unembed.weight.device)))

    def scaled(self, z: torch.Tensor) -> torch.Tensor:
        """z [..., d_vocab], computed with the unembedding's weight directly, times the logits' scale (z itself where
        it is 1): what the unembedding's own forward gives."""
        return z if self.scale == 1.0 else z * self.scale

    @property
    def weight(self) -> torch.Tensor:
        """The unembedding [d_vocab, d_model]."""
        return self.unembed.weight

    @property
    def d_vocab(self) -> int:
        return self.unembed.weight.shape[0]

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm of h, in the model's dtype (h is cast to it first)."""
        weight = self.unembed.weight
        return self.norm(h.to(device=weight.device, dtype=weight.dtype))

    def into(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The readout of rows h [rows, d_model] written into the float32 buffer out [rows, d_vocab]."""
        return self.normed_into(self.normed(h), out)

    def normed_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`into` for rows that are already through the final norm: unembedding, then the cap, into `out`.
        A half-precision model's logits are computed, capped included, in its dtype, as its forward does."""
        weight, bias = self.unembed.weight, self.unembed.bias
        if weight.dtype != out.dtype:
            return out.copy_(self.cap_(self.scaled(linear(x.to(weight.dtype), weight, bias))))
        z = linear_into(x, weight, bias, out)
        return self.cap_(z if self.scale == 1.0 else z.mul_(self.scale))

    def cap_(self, z: torch.Tensor) -> torch.Tensor:
        """The final soft-cap applied to z in place where the model has one; z itself otherwise."""
        if self.softcap is None:
            return z
        if torch.is_grad_enabled() and z.requires_grad:
            return torch.tanh(z / self.softcap) * self.softcap  # out of place, so autograd sees it
        return z.div_(self.softcap).tanh_().mul_(self.softcap)

    def cap_backward_(self, grad: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """grad w.r.t. the capped logits -> grad w.r.t. x W^T (the product with the unembedding's weight), in place:
        through the cap, then the logits' scale. With logits = c tanh(z / c), d logits / d z = 1 - (logits / c)^2,
        read off the capped logits themselves."""
        if self.softcap is not None:
            grad = grad.mul_(1 - (logits / self.softcap).square_())
        return grad if self.scale == 1.0 else grad.mul_(self.scale)

"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE): a router sends each token to k experts, and the
block's write is their weighted sum.

    logits            = x @ W_router.T                        [batch, pos, expert]
    weights, experts  = route(logits, k)                       [batch, pos, k] each
    mlp_out           = Σ_j weights_j · expert_{experts_j}(x)  [batch, pos, d_model]

`route` is one of `ROUTES`, chosen once from `cfg.routing`: a softmax over every expert then the top k, the same
renormalised over those k, or the top k logits then a softmax over them. The softmax runs in float32 whatever the
model's dtype, as transformers runs it. Experts run grouped by expert: the (token, slot) pairs are sorted by the
expert they go to, and each expert that has tokens runs once on all of them, never a loop over tokens nor a dense
pass over every expert.

Hooks: `hook_router_logits` [batch, pos, expert], `hook_expert_indices` and `hook_expert_weights` [batch, pos, k]
(a hook may replace either; the mix uses what it returns), and `hook_expert_out` [batch, pos, k, d_model], each
slot's unweighted expert output, computed only when something is attached to it (it is in the model's
ON_REQUEST list). `mlp_out = Σ_j weights_j · expert_out_j` either way.

Another kind of expert (gpt-oss's clamped SwiGLU with biases) is one more `SwiGLUExpert` subclass in `EXPERTS`, keyed
by `cfg.mlp`; a router bias is the `bias` argument of `MoE.router`.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint
from .linear import Linear


# ------------------------------------------------------------------------------------ routing rules
def softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of softmax(logits) over every expert: weights [..., k] (float32, summing to at most 1), indices."""
    weights, indices = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return weights, indices


def softmax_topk_renorm(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax_topk`, its k weights divided by their sum (Mixtral; Qwen3-MoE and OLMoE with norm_topk_prob)."""
    weights, indices = softmax_topk(logits, k)
    return weights / weights.sum(dim=-1, keepdim=True), indices


def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits, then a softmax over those k (gpt-oss)."""
    top, indices = logits.topk(k, dim=-1)
    return torch.softmax(top.float(), dim=-1), indices


Route = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
ROUTES: dict[str, Route] = {"softmax_topk": softmax_topk, "softmax_topk_renorm": softmax_topk_renorm,
                            "topk_softmax": topk_softmax}


# ------------------------------------------------------------------------------------------- experts
class SwiGLUExpert(nn.Module):
    """One expert: a SwiGLU MLP of width d_expert, fc_out(silu(gate(x)) * fc_in(x)), each projection its own
    matrix as the hub stores them (Mixtral's w1, w3, w2; Qwen3-MoE's and OLMoE's gate_proj, up_proj, down_proj)."""

    BIAS = False  # expert projections with biases (gpt-oss) set this in a subclass

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Linear(cfg.d_model, cfg.d_expert, bias=self.BIAS)
        self.fc_in = Linear(cfg.d_model, cfg.d_expert, bias=self.BIAS)
        self.fc_out = Linear(cfg.d_expert, cfg.d_model, bias=self.BIAS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [token, d_model] -> [token, d_model]
        return self.fc_out(F.silu(self.gate(x)) * self.fc_in(x))


EXPERTS: dict[str, type[SwiGLUExpert]] = {"swiglu": SwiGLUExpert}  # cfg.mlp -> the expert piece


class MoE(nn.Module):
    """A router and `n_experts` experts; each token's write is the weighted sum of its k experts' outputs.

    Weight views, per expert as TransformerLens shows a dense MLP's (`x @ W + b`): `W_in`, `W_gate`
    [expert, d_model, d_expert], `W_out` [expert, d_expert, d_model], biases [expert, d_expert] and
    [expert, d_model] (zeros where the experts have none), `W_router` [d_model, expert]. They are copies.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.mlp not in EXPERTS:
            raise ValueError(f"ModelConfig.mlp={cfg.mlp!r} has no expert piece for a mixture of experts; "
                             f"lenskit implements experts of kind {sorted(EXPERTS)}")
        self.k = cfg.n_experts_per_token
        self.route = ROUTES[cfg.routing]
        self.router = Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(EXPERTS[cfg.mlp](cfg) for _ in range(cfg.n_experts))
        self.hook_router_logits = HookPoint()  # [batch, pos, expert]
        self.hook_expert_indices = HookPoint()  # [batch, pos, k], long
        self.hook_expert_weights = HookPoint()  # [batch, pos, k], the model's dtype
        self.hook_expert_out = HookPoint()  # [batch, pos, k, d_model], unweighted; computed only when hooked

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, pos, d_model]
        logits = self.hook_router_logits(self.router(x))  # [batch, pos, expert]
        weights, chosen = self.route(logits, self.k)  # [batch, pos, k] each
        chosen = self.hook_expert_indices(chosen)
        weights = self.hook_expert_weights(weights.to(x.dtype))
        if self.hook_expert_out.has_hooks():
            out = self.hook_expert_out(self.expert_outputs(x, chosen))  # [batch, pos, k, d_model]
            return (weights.unsqueeze(-1) * out).sum(dim=-2)
        return self.mixed(x, weights, chosen)

    def mixed(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Σ_j weights_j · expert_{chosen_j}(x) [batch, pos, d_model], each expert run once on all its tokens."""
        flat = x.reshape(-1, x.shape[-1])  # [token, d_model]
        w = weights.reshape(-1, 1)  # [token * k, 1]
        out = torch.zeros_like(flat)
        for e, slots in self._groups(chosen):
            token = slots // self.k
            out.index_add_(0, token, self.experts[e](flat[token]) * w[slots])
        return out.view_as(x)

    def expert_outputs(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each slot's unweighted expert output [batch, pos, k, d_model]."""
        flat = x.reshape(-1, x.shape[-1])  # [token, d_model]
        out = flat.new_empty(chosen.numel(), flat.shape[-1])  # [token * k, d_model]
        for e, slots in self._groups(chosen):
            out[slots] = self.experts[e](flat[slots // self.k])
        return out.view(*chosen.shape, flat.shape[-1])

    def _groups(self, chosen: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(expert, the flat slot indices [n] routed to it) for each expert that has tokens, in expert order."""
        flat = chosen.reshape(-1)  # [token * k]
        counts = torch.bincount(flat, minlength=len(self.experts))
        if counts.numel() > len(self.experts) or (flat.numel() and int(flat.min()) < 0):
            raise ValueError(f"expert indices must lie in [0, {len(self.experts)}), got {int(flat.min())}..{int(flat.max())}; "
                             "a hook on hook_expert_indices returned an index outside the experts")
        order = flat.argsort(stable=True)  # slots sorted by their expert
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                yield e, order[start:start + n]
            start += n

    # ------------------------------------------------------------------ weight views
    def _stack(self, proj: str, part: str = "weight") -> torch.Tensor:
        layers = [getattr(e, proj) for e in self.experts]
        if part == "weight":
            return torch.stack([layer.weight.T for layer in layers])
        return torch.stack([layer.weight.new_zeros(layer.weight.shape[0]) if layer.bias is None else layer.bias
                            for layer in layers])

    @property
    def W_router(self) -> torch.Tensor:
        return self.router.weight.T  # [d_model, expert]

    @property
    def W_in(self) -> torch.Tensor:
        return self._stack("fc_in")  # [expert, d_model, d_expert]

    @property
    def W_gate(self) -> torch.Tensor:
        return self._stack("gate")  # [expert, d_model, d_expert]

    @property
    def W_out(self) -> torch.Tensor:
        return self._stack("fc_out")  # [expert, d_expert, d_model]

    @property
    def b_in(self) -> torch.Tensor:
        return self._stack("fc_in", "bias")  # [expert, d_expert]

    @property
    def b_gate(self) -> torch.Tensor:
        return self._stack("gate", "bias")  # [expert, d_expert]

    @property
    def b_out(self) -> torch.Tensor:
        return self._stack("fc_out", "bias")  # [expert, d_model]

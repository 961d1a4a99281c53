"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE, gpt-oss): a router sends each token to k experts, and the
block's write is their weighted sum.

    logits            = x @ W_router.T (+ b_router)           [batch, pos, expert]
    weights, experts  = route(logits, k)                       [batch, pos, k] each
    mlp_out           = Σ_j weights_j · expert_{experts_j}(x)  [batch, pos, d_model]

`route` is one of `ROUTES`, chosen once from `cfg.moe.routing`: a softmax over every expert then the top k, the same
renormalised over those k, or the top k logits then a softmax over them. Each softmax runs in the dtype transformers
runs it in: float32 after a softmax over every expert, the logits' own dtype for gpt-oss's top k. Experts run grouped by expert: the (token, slot) pairs are sorted by the
expert they go to, and each expert that has tokens runs once on all of them, never a loop over tokens nor a dense
pass over every expert.

Hooks: `hook_router_logits` [batch, pos, expert], `hook_expert_indices` and `hook_expert_weights` [batch, pos, k]
(a hook may replace either; the mix uses what it returns), and `hook_expert_out` [batch, pos, k, d_model], each
slot's unweighted expert output, computed only when something is attached to it (it is in the model's
ON_REQUEST list). `mlp_out = Σ_j weights_j · expert_out_j` either way, summed in the same order, so a hook that only
reads expert_out leaves the numbers as they were.

The kind of expert is `EXPERTS[cfg.mlp]`: the SwiGLU expert, gpt-oss's biased one with the clamped SwiGLU
(`ClampedSwiGLUExpert`), or Nemotron-H's ungated one (`PlainExpert`, its `W_gate` None); the router has a bias where `cfg.moe.router_bias` says so (gpt-oss).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint
from .linear import Linear, write_projection, written
from .mlp import activation


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
    """The k largest logits, in descending order, then a softmax over those k alone, so each token's weights sum to
    one (gpt-oss; in the logits' dtype, as transformers' GptOssTopKRouter computes it)."""
    top, indices = logits.topk(k, dim=-1)
    return torch.softmax(top, dim=-1), indices


Route = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
ROUTES: dict[str, Route] = {"softmax_topk": softmax_topk, "softmax_topk_renorm": softmax_topk_renorm,
                            "topk_softmax": topk_softmax}


def expert_slots(chosen: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The flat slot indices [token * k] sorted by expert (stably) and each expert's count of them: `chosen` [..., k]
    flattened, so slot s is token s // k's (s % k)-th choice."""
    flat = chosen.reshape(-1)  # [token * k]
    # Checked before bincount, which refuses a negative index with its own message and counts a large one silently.
    if flat.is_floating_point() or flat.dtype == torch.bool:
        raise ValueError(f"expert indices must be an integer tensor, got {flat.dtype}; "
                         "a hook on hook_expert_indices returned another dtype")
    lo, hi = torch.stack(torch.aminmax(flat)).tolist() if flat.numel() else (0, 0)  # one wait, as the counts take
    if lo < 0 or hi >= n_experts:
        raise ValueError(f"expert indices must lie in [0, {n_experts}), got {lo}..{hi}; "
                         "a hook on hook_expert_indices returned an index outside the experts")
    return flat.argsort(stable=True), torch.bincount(flat, minlength=n_experts).tolist()


def expert_groups(chosen: torch.Tensor, n_experts: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(expert, the flat slot indices [n] routed to it) for each expert that has tokens, in expert order (see
    `expert_slots`)."""
    order, counts = expert_slots(chosen, n_experts)
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, order[start:start + n]
        start += n


# ------------------------------------------------------------------------------------------- experts
class SwiGLUExpert(nn.Module):
    """One expert: a SwiGLU MLP of width d_expert, fc_out(silu(gate(x)) * fc_in(x)), each projection its own
    matrix as the hub stores them (Mixtral's w1, w3, w2; Qwen3-MoE's and OLMoE's gate_proj, up_proj, down_proj)."""

    BIAS = False  # expert projections with biases (gpt-oss) set this in a subclass

    @classmethod
    def params(cls, cfg: ModelConfig) -> tuple[int, int]:
        """One expert's (weights, biases): its gate, up and down projections."""
        d, m = cfg.d_model, cfg.moe.d_expert
        return 3 * d * m, (2 * m + d if cls.BIAS else 0)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Linear(cfg.d_model, cfg.moe.d_expert, bias=self.BIAS)
        self.fc_in = Linear(cfg.d_model, cfg.moe.d_expert, bias=self.BIAS)
        self.fc_out = write_projection(cfg.moe.d_expert, cfg.d_model, self.BIAS, cfg.scales.residual)

    def norm_readers(self) -> list[nn.Linear]:
        """Its projections that read the normalised stream: gate and input."""
        return [self.gate, self.fc_in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [token, d_model] -> [token, d_model]
        return self.fc_out(F.silu(self.gate(x)) * self.fc_in(x))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation, [..., d_expert] each -> [..., d_expert]: the gate clamped from above at `limit`, the
    up projection to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate). The + 1 is gpt-oss's: an up
    projection of zero passes the gate through."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


class ClampedSwiGLUExpert(SwiGLUExpert):
    """gpt-oss's expert: biased projections, fc_out(clamped_swiglu(gate(x), fc_in(x))) with the config's
    `swiglu_alpha` and `swiglu_limit`. Its checkpoints fuse gate and fc_in, interleaved (`lenskit.families.gpt_oss.GptOssExperts`)."""

    BIAS = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.alpha, self.limit = cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [token, d_model] -> [token, d_model]
        return self.fc_out(clamped_swiglu(self.gate(x), self.fc_in(x), self.alpha, self.limit))


class PlainExpert(nn.Module):
    """One ungated expert (mlp="gelu"): fc_out(act(fc_in(x))) with the config's activation (Nemotron-H's squared
    ReLU), no biases; it has no `gate`, so the MoE's `W_gate` and `b_gate` are None."""

    @classmethod
    def params(cls, cfg: ModelConfig) -> tuple[int, int]:
        return 2 * cfg.d_model * cfg.moe.d_expert, 0

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc_in = Linear(cfg.d_model, cfg.moe.d_expert, bias=False)
        self.fc_out = write_projection(cfg.moe.d_expert, cfg.d_model, False, cfg.scales.residual)
        self.act = activation(cfg)

    def norm_readers(self) -> list[nn.Linear]:
        return [self.fc_in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [token, d_model] -> [token, d_model]
        return self.fc_out(self.act(self.fc_in(x)))


# cfg.mlp -> the expert piece (swiglu_fused: Granite's, whose dense MLP fuses gate and up; its experts are split per
# expert from the fused file tensors, lenskit.families.layouts.FusedExperts)
EXPERTS: dict[str, type[SwiGLUExpert] | type[PlainExpert]] = {
    "swiglu": SwiGLUExpert, "swiglu_fused": SwiGLUExpert, "swiglu_clamped": ClampedSwiGLUExpert, "gelu": PlainExpert}


class MoE(nn.Module):
    """A router and `n_experts` experts; each token's write is the weighted sum of its k experts' outputs.

    Weight views, per expert as TransformerLens shows a dense MLP's (`x @ W + b`): `W_in`, `W_gate`
    [expert, d_model, d_expert], `W_out` [expert, d_expert, d_model], biases [expert, d_expert] and
    [expert, d_model] (zeros where the experts have none), `W_router` [d_model, expert], `b_router` [expert] (zeros
    without a router bias). They are copies.
    """

    @classmethod
    def expert_params(cls, cfg: ModelConfig) -> tuple[int, int]:
        """One expert's (weights, biases)."""
        return EXPERTS[cfg.mlp].params(cfg)

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Its parameters by accounting row (lenskit.accounting), as (weights, biases): the router (and its bias) and
        every expert under `mlp`."""
        weights, biases = cls.expert_params(cfg)
        return {"mlp": (cfg.d_model * cfg.moe.n_experts + cfg.moe.n_experts * weights,
                        (cfg.moe.n_experts if cfg.moe.router_bias else 0) + cfg.moe.n_experts * biases)}

    @classmethod
    def active_weights(cls, cfg: ModelConfig, layer: int = 0) -> int:
        """The weights one token's forward multiplies: the router and its k routed experts."""
        return cfg.d_model * cfg.moe.n_experts + cfg.moe.n_experts_per_token * cls.expert_params(cfg)[0]

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.mlp not in EXPERTS:
            raise ValueError(f"ModelConfig.mlp={cfg.mlp!r} has no expert piece for a mixture of experts; "
                             f"lenskit implements experts of kind {sorted(EXPERTS)}")
        self.k = cfg.moe.n_experts_per_token
        self.route = self.routing_rule(cfg)
        self.router = Linear(cfg.d_model, cfg.moe.n_experts, bias=cfg.moe.router_bias)
        self.experts = nn.ModuleList(EXPERTS[cfg.mlp](cfg) for _ in range(cfg.moe.n_experts))
        self.hook_router_logits = HookPoint()  # [batch, pos, expert]
        self.hook_expert_indices = HookPoint(integer=True)  # [batch, pos, k], long
        self.hook_expert_weights = HookPoint()  # [batch, pos, k], the model's dtype
        self.hook_expert_out = HookPoint()  # [batch, pos, k, d_model], unweighted; computed only when hooked

    def routing_rule(self, cfg: ModelConfig) -> Route:
        """The rule from router logits to (weights, indices), `ROUTES[cfg.moe.routing]`; a piece with a rule of its own
        (lenskit.pieces.shared_experts) overrides this."""
        if cfg.moe.routing not in ROUTES:
            raise ValueError(f"routing={cfg.moe.routing!r} is not one of MoE's rules {sorted(ROUTES)}; DeepSeek's "
                             "sigmoid routing is lenskit.pieces.shared_experts.SharedExpertsMoE's")
        return ROUTES[cfg.moe.routing]

    def norm_readers(self) -> list[nn.Linear]:
        """The projections that read the normalised stream, into which fold_ln folds the norm before the MLP
        (lenskit.processing): the router and every expert's gate and input, as TransformerLens folds them."""
        return [self.router, *(layer for expert in self.experts for layer in expert.norm_readers())]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, pos, d_model]
        logits = self.hook_router_logits(self.router(x))  # [batch, pos, expert]
        weights, chosen = self.route(logits, self.k)  # [batch, pos, k] each
        chosen = self.hook_expert_indices(chosen)
        weights = self.hook_expert_weights(weights.to(x.dtype))
        if self.hook_expert_out.has_hooks():
            out = self.hook_expert_out(self.expert_outputs(x, chosen))  # [batch, pos, k, d_model]
            by_slot = out.reshape(-1, out.shape[-1])  # [token * k, d_model]
            return self._summed(x, weights, chosen, lambda e, slots, tokens: by_slot[slots])
        return self.mixed(x, weights, chosen)

    def mixed(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Σ_j weights_j · expert_{chosen_j}(x) [batch, pos, d_model], each expert run once on all its tokens."""
        flat = x.reshape(-1, x.shape[-1])  # [token, d_model]
        return self._summed(x, weights, chosen, lambda e, slots, tokens: self.experts[e](flat[tokens]))

    def _summed(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                output: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Σ_j weights_j · output(expert, slots, their tokens) [batch, pos, d_model], added expert by expert: the one
        order of the sum whether the outputs are computed here or read from hook_expert_out, so that hooking it only to
        read leaves mlp_out bit for bit as it was. The slots' tokens and weights are taken once for all the experts:
        per expert, views of them (few tokens per expert make the per-expert ops count)."""
        order, counts = expert_slots(chosen, len(self.experts))
        tokens, w = order // self.k, weights.reshape(-1, 1)[order]  # [token * k], [token * k, 1]
        out = x.new_zeros(x.shape[:-1].numel(), x.shape[-1])  # [token, d_model]
        start = 0
        for e, n in enumerate(counts):
            if n:
                end = start + n
                out.index_add_(0, tokens[start:end], output(e, order[start:end], tokens[start:end]) * w[start:end])
            start += n
        return out.view_as(x)

    def expert_outputs(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each slot's unweighted expert output [batch, pos, k, d_model]."""
        flat = x.reshape(-1, x.shape[-1])  # [token, d_model]
        out = flat.new_empty(chosen.numel(), flat.shape[-1])  # [token * k, d_model]
        for e, slots in self._groups(chosen):
            out[slots] = self.experts[e](flat[slots // self.k])
        return out.view(*chosen.shape, flat.shape[-1])

    def _groups(self, chosen: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        return expert_groups(chosen, len(self.experts))

    # ------------------------------------------------------------------ weight views
    def _stack(self, proj: str, part: str = "weight") -> torch.Tensor:
        layers = [getattr(e, proj) for e in self.experts]  # fc_out's views times the residual scale, where it has one
        if part == "weight":
            return torch.stack([written(layer, layer.weight.T) for layer in layers])
        return torch.stack([layer.weight.new_zeros(layer.weight.shape[0]) if layer.bias is None
                            else written(layer, layer.bias) for layer in layers])

    @property
    def W_router(self) -> torch.Tensor:
        return self.router.weight.T  # [d_model, expert]

    @property
    def b_router(self) -> torch.Tensor:
        bias = self.router.bias
        return self.router.weight.new_zeros(self.router.weight.shape[0]) if bias is None else bias  # [expert]

    @property
    def W_in(self) -> torch.Tensor:
        return self._stack("fc_in")  # [expert, d_model, d_expert]

    @property
    def W_gate(self) -> torch.Tensor | None:
        return self._stack("gate") if hasattr(self.experts[0], "gate") else None  # [expert, d_model, d_expert]

    @property
    def W_out(self) -> torch.Tensor:
        return self._stack("fc_out")  # [expert, d_expert, d_model]

    @property
    def b_in(self) -> torch.Tensor:
        return self._stack("fc_in", "bias")  # [expert, d_expert]

    @property
    def b_gate(self) -> torch.Tensor | None:
        return self._stack("gate", "bias") if hasattr(self.experts[0], "gate") else None  # [expert, d_expert]

    @property
    def b_out(self) -> torch.Tensor:
        return self._stack("fc_out", "bias")  # [expert, d_model]

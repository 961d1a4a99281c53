"""Mixtures of experts with shared experts that every token runs beside the routed ones: DeepSeek V3's (routed experts
chosen by sigmoid scores within the best groups), Qwen3-Next's (MoE's softmax routing, one shared expert whose output
a sigmoid gate scales per token) and Granite 4's (the top k logits then a softmax, its shared MLP fused as its dense
MLP is).

    logits   = x @ W_router.T                                              [batch, pos, expert] (float32)
    scores   = sigmoid(logits)
    choice   = scores + e_score_correction_bias                            (the bias steers the choice only)
    groups   = the topk_group best of n_group groups, a group scored by its best two choices
    experts  = the k best choices among the experts of those groups        [batch, pos, k]
    weights  = scores[experts] (/ their sum, for routing "_renorm") * routed_scaling_factor
    mlp_out  = Σ_j weights_j · expert_{experts_j}(x) + shared(x)          [batch, pos, d_model]

`shared` is one dense MLP of the config's kind (SwiGLU for DeepSeek and Qwen3-Next, Nemotron-H's squared-ReLU one,
Granite's fused SwiGLU), `n_shared_experts * d_expert` wide (transformers' `shared_experts`, which stores the shared
experts fused), or `moe.d_shared` wide where the config gives its own width (Qwen3-Next's
shared_expert_intermediate_size, Nemotron-H's, Granite's `shared_mlp`). Under a routing rule other than DeepSeek's the
routed experts are `MoE`'s, with no correction bias. Qwen3-Next gates the shared MLP: with `moe.shared_gate`, its
output is times sigmoid(x @ w_shared_gate) [batch, pos, 1] (`hook_shared_gate`), and `hook_shared_out` is the gated
output, what is added. The routed experts, their grouped run, weight views and hooks are `lenskit.pieces.moe.MoE`'s:
`hook_router_logits` [batch, pos, expert] (before the sigmoid; a hook may edit it, and an expert whose logit it sets
to -inf, as expert ablation's reroute does, is never chosen, whatever its bias), `hook_expert_indices` and
`hook_expert_weights` [batch, pos, k] (after the scaling factor: what multiplies each expert's output),
`hook_expert_out` [batch, pos, k, d_model] on request; and beside them `hook_routed_out` and `hook_shared_out`
[batch, pos, d_model], the routed experts' weighted sum and the shared experts' output, whose sum is the write. The
shared MLP's own hooks (`shared.hook_pre`, `shared.hook_post` ...) are its dense MLP's.

The k experts are listed best choice first (transformers leaves their order to `topk(sorted=False)`; the sum is the
same set of terms).

Llama 4's MoE (`ScoredInputMoE`) has one shared expert too, but routes by the sigmoid of the top k logits and scales
each routed expert's input, not its output, by that weight.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint
from .linear import Linear
from .mlp import MLP_CLASSES, SwiGLU
from .moe import MoE, Route


def grouped_sigmoid_topk(logits: torch.Tensor, k: int, correction: torch.Tensor, n_group: int, topk_group: int,
                         renorm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek V3's rule: weights [..., k] (float32) and expert indices [..., k] from router logits [..., expert]
    (see the module docstring). `correction` [expert] is added to the scores for the choice alone."""
    scores = logits.float().sigmoid()  # [..., expert]
    # an expert whose logit a hook set to -inf (expert ablation's reroute) is out of the choice, whatever its bias
    choice = (scores + correction.float()).masked_fill(logits == float("-inf"), float("-inf"))
    n_experts = choice.shape[-1]
    by_group = choice.unflatten(-1, (n_group, n_experts // n_group))  # [..., group, expert / group]
    group_scores = by_group.topk(2, dim=-1).values.sum(-1)  # [..., group]
    best_groups = group_scores.topk(topk_group, dim=-1).indices  # [..., topk_group]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best_groups, True)  # [..., group]
    choice = by_group.masked_fill(~kept[..., None], float("-inf")).flatten(-2)  # [..., expert]
    indices = choice.topk(k, dim=-1).indices  # [..., k], best first
    weights = scores.gather(-1, indices)
    if renorm:  # transformers' 1e-20 keeps an all-zero row finite
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, indices


def shared_width(cfg: ModelConfig) -> int:
    """The shared MLP's hidden width: `moe.d_shared` where given (Qwen3-Next's, Nemotron-H's), else n_shared_experts
    experts' widths side by side."""
    return cfg.moe.d_shared if cfg.moe.d_shared is not None else cfg.moe.n_shared_experts * cfg.moe.d_expert


def _shared_params(cfg: ModelConfig) -> tuple[int, int]:
    """The shared MLP's and its gate's (weights, biases): a dense MLP of the config's kind, `shared_width` wide, and
    d_model weights for a gate; none without a shared expert."""
    if not cfg.moe.n_shared_experts:
        return 0, 0
    weights, biases = MLP_CLASSES[cfg.mlp].params(cfg.replace(d_mlp=shared_width(cfg)))["mlp"]
    return weights + (cfg.d_model if cfg.moe.shared_gate else 0), biases


class SharedExpertsMoE(MoE):
    """MoE with shared experts (see the module docstring): `MoE`'s router and experts and the dense `shared` MLP of
    the config's kind beside them (absent where n_shared_experts is 0, when `hook_shared_out` reads zeros), with its
    sigmoid gate `shared_gate` where `moe.shared_gate`. Under DeepSeek's routing ("sigmoid_group_topk") the routing is
    `grouped_sigmoid_topk` with the buffer `e_score_correction_bias` [expert] (a checkpoint's, fixed: it is updated
    outside of gradient descent in training); under another it is MoE's."""

    def __init__(self, cfg: ModelConfig) -> None:
        moe = cfg.moe
        self.grouped = moe.routing.startswith("sigmoid_group_topk")
        if not (self.grouped or moe.n_shared_experts):
            raise ValueError(f"SharedExpertsMoE routes as DeepSeek V3 does (routing 'sigmoid_group_topk' or "
                             f"'sigmoid_group_topk_renorm') or has shared experts; got routing={moe.routing!r} and none: "
                             "use lenskit.pieces.moe.MoE")
        super().__init__(cfg)
        if self.grouped:
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.n_experts))  # [expert]
        self.n_group, self.topk_group = moe.n_group, moe.topk_group
        self.renorm, self.scaling = moe.routing.endswith("_renorm"), moe.routed_scaling_factor
        self.shared = MLP_CLASSES[cfg.mlp](cfg, shared_width(cfg)) if moe.n_shared_experts else None
        self.shared_gate = Linear(cfg.d_model, 1, bias=False) if moe.shared_gate else None
        if moe.shared_gate:
            self.hook_shared_gate = HookPoint()  # [batch, pos, 1], in (0, 1)
        self.hook_routed_out = HookPoint()  # [batch, pos, d_model]
        self.hook_shared_out = HookPoint()  # [batch, pos, d_model]

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Its parameters by accounting row, as (weights, biases): the router, every routed expert, the shared MLP and
        its gate under `mlp` (the correction bias is a buffer, as in transformers, and not counted)."""
        moe = cfg.moe
        expert, _ = cls.expert_params(cfg)
        shared_w, shared_b = _shared_params(cfg)
        return {"mlp": (cfg.d_model * moe.n_experts + moe.n_experts * expert + shared_w, shared_b)}

    @classmethod
    def active_weights(cls, cfg: ModelConfig, layer: int = 0) -> int:
        """The weights one token's forward multiplies: the router, its k routed experts, the shared MLP and its gate."""
        moe = cfg.moe
        return cfg.d_model * moe.n_experts + moe.n_experts_per_token * cls.expert_params(cfg)[0] + _shared_params(cfg)[0]

    def norm_readers(self) -> list[nn.Linear]:
        """The router's, every routed expert's, the shared MLP's and its gate's projections that read the normalised
        stream."""
        shared = [] if self.shared is None else self.shared.norm_readers()
        return [*super().norm_readers(), *shared, *([] if self.shared_gate is None else [self.shared_gate])]

    def routing_rule(self, cfg: ModelConfig) -> Route:
        return self._route if cfg.moe.routing.startswith("sigmoid_group_topk") else super().routing_rule(cfg)

    def _route(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights and indices [..., k] from logits [..., expert]: `grouped_sigmoid_topk` with this block's settings."""
        return grouped_sigmoid_topk(logits, k, self.e_score_correction_bias, self.n_group, self.topk_group,
                                    self.renorm, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, pos, d_model]
        routed = self.hook_routed_out(super().forward(x))
        shared = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        if self.shared_gate is not None:
            shared = self.hook_shared_gate(torch.sigmoid(self.shared_gate(x))) * shared
        return routed + self.hook_shared_out(shared)


# ------------------------------------------------------------------------------------------------- Llama 4
def sigmoid_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's rule: the k largest logits [..., k], best first, and as weights their sigmoids (float32), which need
    not sum to 1."""
    top, indices = logits.topk(k, dim=-1)
    return top.float().sigmoid(), indices


class ScoredInputMoE(MoE):
    """Llama 4's MoE MLP: `MoE`'s router and SwiGLU experts routed by `sigmoid_topk`, each routed expert reading the
    stream scaled by its weight (not its output scaled), and a shared dense SwiGLU MLP `n_shared_experts * d_expert`
    wide (Llama 4's one `shared_expert`) beside them:

        mlp_out = Σ_j expert_{experts_j}(weights_j · x) + shared(x)           [batch, pos, d_model]

    Hooks: `MoE`'s `hook_router_logits`, `hook_expert_indices` and `hook_expert_weights` (the sigmoids, what scales each
    expert's input); `hook_expert_out` [batch, pos, k, d_model] on request, each slot's output expert(weight · x),
    which the sum adds as it is (a weight of 0, expert ablation's "zero", makes it 0: the experts have no biases); and
    `hook_routed_out` and `hook_shared_out` [batch, pos, d_model] as in `SharedExpertsMoE`, whose sum is the write."""

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Its parameters by accounting row, as (weights, biases): the router, every routed expert and the shared MLP."""
        return SharedExpertsMoE.params(cfg, layer)

    @classmethod
    def active_weights(cls, cfg: ModelConfig, layer: int = 0) -> int:
        """The weights one token's forward multiplies: the router, its k routed experts and the shared experts."""
        return SharedExpertsMoE.active_weights(cfg, layer)

    def __init__(self, cfg: ModelConfig) -> None:
        moe = cfg.moe
        if moe.routing != "sigmoid_topk" or cfg.mlp != "swiglu":
            raise ValueError(f"ScoredInputMoE routes as Llama 4 does (routing 'sigmoid_topk', SwiGLU experts), got "
                             f"routing={moe.routing!r}, mlp={cfg.mlp!r}; use lenskit.pieces.moe.MoE")
        super().__init__(cfg)
        self.shared = SwiGLU(cfg, shared_width(cfg)) if moe.n_shared_experts else None
        self.hook_routed_out = HookPoint()  # [batch, pos, d_model]
        self.hook_shared_out = HookPoint()  # [batch, pos, d_model]

    def routing_rule(self, cfg: ModelConfig) -> Route:
        return sigmoid_topk

    def norm_readers(self) -> list[nn.Linear]:
        """The router's, every routed expert's and the shared MLP's projections that read the normalised stream."""
        return [*super().norm_readers(), *([] if self.shared is None else self.shared.norm_readers())]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, pos, d_model]
        logits = self.hook_router_logits(self.router(x))  # [batch, pos, expert]
        weights, chosen = self.route(logits, self.k)  # [batch, pos, k] each
        chosen = self.hook_expert_indices(chosen)
        weights = self.hook_expert_weights(weights.to(x.dtype))
        ones = torch.ones_like(weights)  # the weights are inside each slot's output; times 1 leaves it bit for bit
        if self.hook_expert_out.has_hooks():
            out = self.hook_expert_out(self.scored_outputs(x, weights, chosen))  # [batch, pos, k, d_model]
            by_slot = out.reshape(-1, out.shape[-1])  # [token * k, d_model]
            routed = self._summed(x, ones, chosen, lambda e, slots, tokens: by_slot[slots])
        else:
            routed = self._summed(x, ones, chosen, self._slot_output(x, weights))
        shared = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        return self.hook_routed_out(routed) + self.hook_shared_out(shared)

    def _slot_output(self, x: torch.Tensor, weights: torch.Tensor):
        """(expert, slots, their tokens) -> expert(weight · x) [n, d_model] for those slots, each expert run once on all
        of them."""
        flat, w = x.reshape(-1, x.shape[-1]), weights.reshape(-1, 1)  # [token, d_model], [token * k, 1]
        return lambda e, slots, tokens: self.experts[e](flat[tokens] * w[slots])

    def scored_outputs(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each slot's output expert(weight · x) [batch, pos, k, d_model]."""
        output = self._slot_output(x, weights)
        out = x.new_empty(chosen.numel(), x.shape[-1])  # [token * k, d_model]
        for e, slots in self._groups(chosen):
            out[slots] = output(e, slots, slots // self.k)
        return out.view(*chosen.shape, x.shape[-1])

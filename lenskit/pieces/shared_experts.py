"""Routed experts plus shared experts that every token runs: DeepSeek V3's (routed by sigmoid scores within the best
groups) and Granite 4's (routed by `lenskit.pieces.moe`'s rules, its shared MLP fused as its dense MLP is).

    logits   = x @ W_router.T                                              [batch, pos, expert] (float32)
    scores   = sigmoid(logits)
    choice   = scores + e_score_correction_bias                            (the bias steers the choice only)
    groups   = the topk_group best of n_group groups, a group scored by its best two choices
    experts  = the k best choices among the experts of those groups        [batch, pos, k]
    weights  = scores[experts] (/ their sum, for routing "_renorm") * routed_scaling_factor
    mlp_out  = Σ_j weights_j · expert_{experts_j}(x) + shared(x)          [batch, pos, d_model]

`shared` is one dense MLP of the config's kind (SwiGLU for DeepSeek, Nemotron-H's squared-ReLU one, Granite's fused
SwiGLU), `n_shared_experts * d_expert` wide or `moe.d_shared` where given (transformers' `shared_experts`, which stores
the shared experts fused; Granite's `shared_mlp`). Under another routing rule (Granite 4: the top k logits then a
softmax) the routed experts are `MoE`'s, with no correction bias, and the shared MLP is added to them the same way.
The routed experts, their grouped run, weight views and hooks are `lenskit.pieces.moe.MoE`'s:
`hook_router_logits` [batch, pos, expert] (before the sigmoid; a hook may edit it, and an expert whose logit it sets
to -inf, as expert ablation's reroute does, is never chosen, whatever its bias), `hook_expert_indices` and
`hook_expert_weights` [batch, pos, k] (after the scaling factor: what multiplies each expert's output),
`hook_expert_out` [batch, pos, k, d_model] on request; and beside them `hook_routed_out` and `hook_shared_out`
[batch, pos, d_model], the routed experts' weighted sum and the shared experts' output, whose sum is the write. The
shared MLP's own hooks (`shared.hook_pre`, `shared.hook_post` ...) are its dense MLP's.

The k experts are listed best choice first (transformers leaves their order to `topk(sorted=False)`; the sum is the
same set of terms).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint
from .mlp import MLP_CLASSES
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
    """The shared MLP's width: `moe.d_shared` where given (Nemotron-H's), else n_shared_experts * d_expert."""
    return cfg.moe.d_shared if cfg.moe.d_shared is not None else cfg.moe.n_shared_experts * cfg.moe.d_expert


def _shared_params(cfg: ModelConfig) -> tuple[int, int]:
    """The shared MLP's (weights, biases): a dense MLP of the config's kind, `shared_width` wide; none without one."""
    if not cfg.moe.n_shared_experts:
        return 0, 0
    return MLP_CLASSES[cfg.mlp].params(cfg.replace(d_mlp=shared_width(cfg)))["mlp"]


class SharedExpertsMoE(MoE):
    """The MoE MLP with shared experts (see the module docstring): `MoE`'s router and experts and the dense
    `shared` MLP beside them (absent where n_shared_experts is 0, when `hook_shared_out` reads zeros). Under DeepSeek
    V3's routing (`sigmoid_group_topk`) the routing is `grouped_sigmoid_topk`, with the buffer
    `e_score_correction_bias` [expert] (a checkpoint's, fixed: it is updated outside of gradient descent in training);
    under another rule (Granite 4's) it is `MoE`'s."""

    def __init__(self, cfg: ModelConfig) -> None:
        moe = cfg.moe
        grouped = moe.routing.startswith("sigmoid_group_topk")
        if not grouped and not moe.n_shared_experts:
            raise ValueError(f"SharedExpertsMoE under routing={moe.routing!r} needs shared experts (n_shared_experts > 0), "
                             "got none; use lenskit.pieces.moe.MoE")
        super().__init__(cfg)
        if grouped:
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.n_experts))  # [expert]
        self.n_group, self.topk_group = moe.n_group, moe.topk_group
        self.renorm, self.scaling = moe.routing.endswith("_renorm"), moe.routed_scaling_factor
        self.shared = MLP_CLASSES[cfg.mlp](cfg, shared_width(cfg)) if moe.n_shared_experts else None
        self.hook_routed_out = HookPoint()  # [batch, pos, d_model]
        self.hook_shared_out = HookPoint()  # [batch, pos, d_model]

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Its parameters by accounting row, as (weights, biases): the router, every routed expert and the shared MLP
        under `mlp` (the correction bias is a buffer, as in transformers, and not counted)."""
        moe = cfg.moe
        expert, _ = cls.expert_params(cfg)
        shared_w, shared_b = _shared_params(cfg)
        return {"mlp": (cfg.d_model * moe.n_experts + moe.n_experts * expert + shared_w, shared_b)}

    @classmethod
    def active_weights(cls, cfg: ModelConfig, layer: int = 0) -> int:
        """The weights one token's forward multiplies: the router, its k routed experts and the shared experts."""
        moe = cfg.moe
        return cfg.d_model * moe.n_experts + moe.n_experts_per_token * cls.expert_params(cfg)[0] + _shared_params(cfg)[0]

    def norm_readers(self) -> list[nn.Linear]:
        """The router's, every routed expert's and the shared MLP's projections that read the normalised stream."""
        return [*super().norm_readers(), *([] if self.shared is None else self.shared.norm_readers())]

    def routing_rule(self, cfg: ModelConfig) -> Route:
        return self._route if cfg.moe.routing.startswith("sigmoid_group_topk") else super().routing_rule(cfg)

    def _route(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights and indices [..., k] from logits [..., expert]: `grouped_sigmoid_topk` with this block's settings."""
        return grouped_sigmoid_topk(logits, k, self.e_score_correction_bias, self.n_group, self.topk_group,
                                    self.renorm, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, pos, d_model]
        routed = self.hook_routed_out(super().forward(x))
        shared = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        return routed + self.hook_shared_out(shared)

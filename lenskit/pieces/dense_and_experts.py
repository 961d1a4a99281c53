"""Gemma 4 26B-A4B's MLP: the dense GeGLU MLP and, beside it, a router and experts, each path with norms of its own;
the block's `ln2_post` normalises their sum, which is the block's one MLP write (`hook_mlp_out`).

    dense   = ln_dense_post(fc_out(act(gate(h)) * fc_in(h)))              h = ln2(x), as in every block
    logits  = router.proj(unit_rms(x) * router.scale * d_model ** -0.5)    x = the stream itself (resid_mid)
    weights, experts = top k of softmax(logits), renormalised to sum 1, each times router.per_expert_scale[e]
    moe     = ln_experts_post(Σ_j weights_j · expert_{experts_j}(ln_experts(x)))
    mlp     = dense + moe                                                  -> the block's ln2_post

The router reads the stream before the MLP's norm, as transformers' `Gemma4TextDecoderLayer` does (its `residual`),
and each expert is a GeGLU of width d_expert. The module is the dense MLP itself (`SwiGLU`: its gate, fc_in, fc_out,
`hook_pre`, `hook_pre_linear`, `hook_post` and weight views `W_in`, `W_gate`, `W_out` are the dense MLP's), with the
mixture's hooks as in `lenskit.pieces.moe`: `hook_router_logits` [batch, pos, expert], `hook_expert_indices` and
`hook_expert_weights` [batch, pos, k] (the weights after `per_expert_scale`, what multiplies each expert's output;
a hook may replace either, so expert ablation, `lenskit.intervene.experts`, works as for the other mixtures), and
`hook_expert_out` [batch, pos, k, d_model] (each slot's unweighted output, before `ln_experts_post`; on request);
and the two paths' writes before their sum, `hook_dense_out` and `hook_moe_out` [batch, pos, d_model].

The experts are kept as transformers stores them, fused (`GatedExperts`: `gate_up` [expert, 2 * d_expert, d_model],
each expert's gate rows then its up rows, and `down` [expert, d_model, d_expert]), and run grouped by expert.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint
from .linear import Linear, linear
from .mlp import SwiGLU
from .moe import ROUTES, expert_groups
from .norms import UnitRMSNorm, make_norm, norm_params


class Router(nn.Module):
    """Gemma 4's router: logits [..., expert] = proj(unit_rms(x) * scale * d_model ** -0.5), x [..., d_model];
    `per_expert_scale` [expert] multiplies each routed weight (applied by the MLP, after the routing rule)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.root = cfg.d_model ** -0.5
        self.norm = UnitRMSNorm(cfg.norm_eps)
        self.scale = nn.Parameter(torch.ones(cfg.d_model))  # [d_model]
        self.proj = Linear(cfg.d_model, cfg.moe.n_experts, bias=False)
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.moe.n_experts))  # [expert]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x) * self.scale * self.root)


class GatedExperts(nn.Module):
    """`n_experts` GeGLU experts in transformers' fused layout (see the module docstring); one expert's forward is
    down[e] @ (act(gate) * up), with gate, up = gate_up[e] @ x."""

    @classmethod
    def params(cls, cfg: ModelConfig) -> tuple[int, int]:
        """One expert's (weights, biases): its fused gate and up rows and its down projection, no biases."""
        return 3 * cfg.d_model * cfg.moe.d_expert, 0

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.d_expert = cfg.moe.n_experts, cfg.moe.d_expert
        self.act = partial(F.gelu, approximate=cfg.gelu_approximate)
        self.gate_up = nn.Parameter(torch.empty(cfg.moe.n_experts, 2 * cfg.moe.d_expert, cfg.d_model))
        self.down = nn.Parameter(torch.empty(cfg.moe.n_experts, cfg.d_model, cfg.moe.d_expert))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x [token, d_model] -> [token, d_model]."""
        gate, up = linear(x, self.gate_up[e]).chunk(2, dim=-1)  # [token, d_expert] each
        return linear(self.act(gate) * up, self.down[e])

    def mixed(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
              outputs: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_j weights_j · expert_{chosen_j}(x) [batch, pos, d_model]; weights, chosen [batch, pos, k]. With `outputs`
        [batch, pos, k, d_model] (hook_expert_out's), those are the experts' outputs, summed in the one order used
        without them, so that hooking them only to read leaves the numbers bit for bit as they were."""
        k = chosen.shape[-1]
        flat = x.reshape(-1, x.shape[-1])  # [token, d_model]
        by_slot = None if outputs is None else outputs.reshape(-1, outputs.shape[-1])  # [token * k, d_model]
        w = weights.reshape(-1, 1)  # [token * k, 1]
        out = torch.zeros_like(flat)
        for e, slots in expert_groups(chosen, self.n_experts):
            token = slots // k
            y = self.expert(e, flat[token]) if by_slot is None else by_slot[slots]
            out.index_add_(0, token, y * w[slots])
        return out.view_as(x)

    def outputs(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Each slot's unweighted expert output [batch, pos, k, d_model]."""
        k = chosen.shape[-1]
        flat = x.reshape(-1, x.shape[-1])
        out = flat.new_empty(chosen.numel(), flat.shape[-1])  # [token * k, d_model]
        for e, slots in expert_groups(chosen, self.n_experts):
            out[slots] = self.expert(e, flat[slots // k])
        return out.view(*chosen.shape, flat.shape[-1])

    # views per expert, as lenskit.pieces.moe.MoE shows them (`x @ W`): views of the fused parameters
    @property
    def W_gate(self) -> torch.Tensor:
        return self.gate_up[:, : self.d_expert].transpose(1, 2)  # [expert, d_model, d_expert]

    @property
    def W_in(self) -> torch.Tensor:
        return self.gate_up[:, self.d_expert:].transpose(1, 2)  # [expert, d_model, d_expert]

    @property
    def W_out(self) -> torch.Tensor:
        return self.down.transpose(1, 2)  # [expert, d_expert, d_model]


class DenseAndExperts(SwiGLU):
    """The dense MLP with a router and experts beside it (see the module docstring). forward(h, x): h = ln2(x)
    [batch, pos, d_model], what the dense MLP reads, and x the stream, what the router and experts read."""

    @classmethod
    def expert_params(cls, cfg: ModelConfig) -> tuple[int, int]:
        """One expert's (weights, biases)."""
        return GatedExperts.params(cfg)

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Its parameters by accounting row (lenskit.accounting), as (weights, biases): the dense MLP, the router (its
        projection, a gain over d_model and a scale per expert) and every expert under `mlp`; its three norms (the
        dense write's, the experts' input's and their write's) under `norms`."""
        dense_w, dense_b = super().params(cfg, layer)["mlp"]
        weights, biases = cls.expert_params(cfg)
        router = cfg.d_model + cfg.moe.n_experts + cfg.d_model * cfg.moe.n_experts
        norm_w, norm_b = norm_params(cfg)
        return {"mlp": (dense_w + router + cfg.moe.n_experts * weights,
                        dense_b + (cfg.moe.n_experts if cfg.moe.router_bias else 0) + cfg.moe.n_experts * biases),
                "norms": (3 * norm_w, 3 * norm_b)}

    @classmethod
    def active_weights(cls, cfg: ModelConfig, layer: int = 0) -> int:
        """The weights one token's forward multiplies: the dense MLP, the router's projection and its k routed experts."""
        return (3 * cfg.d_model * cfg.d_mlp_of(layer) + cfg.d_model * cfg.moe.n_experts
                + cfg.moe.n_experts_per_token * cls.expert_params(cfg)[0])

    def __init__(self, cfg: ModelConfig, d_mlp: int | None = None) -> None:
        super().__init__(cfg, d_mlp)
        self.ln_dense_post = make_norm(cfg)
        self.router = Router(cfg)
        self.ln_experts = make_norm(cfg)
        self.experts = GatedExperts(cfg)
        self.ln_experts_post = make_norm(cfg)
        self.k, self.route = cfg.moe.n_experts_per_token, ROUTES[cfg.moe.routing]
        self.hook_dense_out = HookPoint()  # [batch, pos, d_model]
        self.hook_router_logits = HookPoint()  # [batch, pos, expert]
        self.hook_expert_indices = HookPoint(integer=True)  # [batch, pos, k], long
        self.hook_expert_weights = HookPoint()  # [batch, pos, k], the model's dtype
        self.hook_expert_out = HookPoint()  # [batch, pos, k, d_model], unweighted; computed only when hooked
        self.hook_moe_out = HookPoint()  # [batch, pos, d_model]

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # -> [batch, pos, d_model]
        dense = self.hook_dense_out(self.ln_dense_post(super().forward(h)))
        logits = self.hook_router_logits(self.router(x))  # [batch, pos, expert]
        weights, chosen = self.route(logits, self.k)  # [batch, pos, k] each
        chosen = self.hook_expert_indices(chosen)
        weights = self.hook_expert_weights((weights * self.router.per_expert_scale[chosen]).to(x.dtype))
        inputs = self.ln_experts(x)
        if self.hook_expert_out.has_hooks():
            out = self.hook_expert_out(self.experts.outputs(inputs, chosen))  # [batch, pos, k, d_model]
            moe = self.experts.mixed(inputs, weights, chosen, out)
        else:
            moe = self.experts.mixed(inputs, weights, chosen)
        return dense + self.hook_moe_out(self.ln_experts_post(moe))

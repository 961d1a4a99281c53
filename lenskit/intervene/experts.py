"""Expert ablation in mixture-of-experts blocks (lenskit.pieces.moe), as hook factories.

`Expert(L, e)` names expert e (or several) of block L's MoE MLP. Two modes, for what "without the expert" means:

- "zero": the expert's contribution is zeroed and nothing else changes. Wherever a token routed to the expert,
  its weight becomes 0 (at `blocks.L.mlp.hook_expert_weights`); the other k - 1 experts keep their weights, so
  `mlp_out = clean mlp_out - Σ_{slots routed to e} weight · expert_out` (Llama 4, whose weights scale each expert's
  input: `- Σ expert_out`, its expert_out being expert(weight · x), which a weight of 0 makes 0).
- "reroute": the router runs as if the expert did not exist. Its router logit becomes -inf (at
  `blocks.L.mlp.hook_router_logits`) before the routing rule, so every token that chose it takes its next-best
  expert instead, and the weights are the rule's own over the experts that remain: for softmax-then-top-k
  (Qwen3-MoE, OLMoE) the softmax is over the other experts, so each remaining weight is p_j / (1 - p_e); with
  renormalisation (Mixtral, norm_topk_prob) the new top k are renormalised to sum to 1; for top-k-then-softmax
  (gpt-oss) the softmax is over the new top k. At least k experts must remain.

`positions` restricts either mode to some positions (all by default).

`Expert(L, "shared")` names block L's shared experts (DeepSeek V3, Qwen3-Next; lenskit.pieces.shared_experts), which
every token runs without routing: "zero" zeroes their output (`blocks.L.mlp.hook_shared_out`, after Qwen3-Next's gate);
"reroute" has no meaning for them and is refused.

>>> llama = lenskit.HookedTransformer.from_pretrained("stdlib-llama")
>>> torch.manual_seed(0);  moe = lenskit.HookedTransformer(llama.cfg.replace(n_layers=2, n_experts=4, n_experts_per_token=2))
<torch._C.Generator object at ...>
>>> hooks = expert_ablation_hooks(moe, [Expert(0, 3)], mode="reroute")
>>> logits, cache = moe.run_with_cache(tokens, fwd_hooks=hooks)
>>> bool((cache["blocks.0.mlp.hook_expert_indices"] == 3).any())     # rerouted: no token of block 0 reaches expert 3
False
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..observe.hooks import HookFn
from ..observe.stream import check_layer
from .masks import indices, positions_here, selection_mask

EXPERT_MODES = ("zero", "reroute")
SHARED = "shared"  # Expert(L, SHARED): block L's shared experts


@dataclass(frozen=True)
class Expert:
    """One or several experts of block `layer`'s mixture of experts: `Expert(1, 3)` or `Expert(1, [0, 3])`."""

    layer: int
    experts: tuple[int | str, ...]  # expert indices, or ("shared",)

    def __init__(self, layer: int, experts: int | Iterable[int] | str) -> None:
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "experts", (SHARED,) if experts == SHARED else indices(experts, "experts"))


def _checked(model, target: Expert) -> tuple[int, tuple[int | str, ...]]:
    """(layer, sorted experts) of `target`, refused by name unless the block is a MoE block that has them."""
    cfg = model.cfg
    try:
        layer = check_layer(target.layer, cfg.n_layers)
    except (TypeError, IndexError) as e:
        raise type(e)(f"{target!r}: {e}") from None
    if not cfg.is_moe_layer(layer):
        what = "a dense model" if cfg.moe.n_experts is None else "a dense block of this mixture of experts"
        raise ValueError(f"{target!r}: block {layer} of {cfg.name} has no experts ({what}); name a MoE block")
    if not target.experts:
        raise ValueError(f"{target!r}: no experts given; name at least one")
    if target.experts == (SHARED,):
        if not getattr(cfg.moe, "n_shared_experts", 0):
            raise ValueError(f"{target!r}: block {layer} of {cfg.name} has no shared experts; name routed experts by index")
        return layer, target.experts
    bad = [e for e in target.experts if not 0 <= e < cfg.moe.n_experts]
    if bad:
        raise IndexError(f"{target!r}: expert {bad[0]} is out of range; block {layer} has {cfg.moe.n_experts} experts "
                         f"(0..{cfg.moe.n_experts - 1})")
    return layer, tuple(sorted(set(target.experts)))


def _zero(layer: int, experts: tuple[int, ...], positions: Sequence[int] | None) -> list[tuple[str, HookFn]]:
    """Weight 0 for every slot routed to `experts`: a hook reads the indices, the next one (same block, same
    forward, right after) zeroes those slots' weights."""
    routed: list[torch.Tensor] = []

    def read_indices(chosen: torch.Tensor, hook) -> None:  # [batch, pos, k]
        routed.append(chosen)

    def zero_weights(weights: torch.Tensor, hook) -> torch.Tensor:  # [batch, pos, k]
        if not routed:  # the pair's first hook did not run: a list cut in two, or this hook alone
            raise RuntimeError(f"{hook.name}: the expert ablation's hook on blocks.{layer}.mlp.hook_expert_indices did "
                               "not run before it in this forward; pass both hooks expert_ablation_hooks returns")
        chosen = routed.pop()
        here = positions_here(positions, weights.shape[1], "expert ablation")
        hit = torch.isin(chosen, torch.tensor(experts, device=chosen.device)) & selection_mask(weights, here)
        return weights.masked_fill(hit, 0)

    return [(f"blocks.{layer}.mlp.hook_expert_indices", read_indices),
            (f"blocks.{layer}.mlp.hook_expert_weights", zero_weights)]


def _zero_shared(layer: int, positions: Sequence[int] | None) -> list[tuple[str, HookFn]]:
    def zero(out: torch.Tensor, hook) -> torch.Tensor:  # [batch, pos, d_model]
        return out.masked_fill(selection_mask(out, positions_here(positions, out.shape[1], "expert ablation")), 0)

    return [(f"blocks.{layer}.mlp.hook_shared_out", zero)]


def _reroute(layer: int, experts: tuple[int, ...], positions: Sequence[int] | None) -> list[tuple[str, HookFn]]:
    def remove(logits: torch.Tensor, hook) -> torch.Tensor:  # [batch, pos, expert]
        here = positions_here(positions, logits.shape[1], "expert ablation")
        mask = selection_mask(logits, here, axis=2, units=experts)
        return logits.masked_fill(mask, float("-inf"))

    return [(f"blocks.{layer}.mlp.hook_router_logits", remove)]


def expert_ablation_hooks(model, targets: Expert | Sequence[Expert], mode: str = "zero", *,
                          positions: int | Sequence[int] | None = None) -> list[tuple[str, HookFn]]:
    """Hooks that ablate every expert target at once (see the module docstring for the two modes)."""
    if mode not in EXPERT_MODES:
        raise ValueError(f"unknown expert ablation mode {mode!r}; expected one of {', '.join(EXPERT_MODES)}")
    targets = [targets] if isinstance(targets, Expert) else list(targets)
    if not targets:
        raise ValueError("no expert targets given; pass e.g. [Expert(0, 3)]")
    by_layer: dict[int, set[int | str]] = {}
    for target in targets:
        layer, experts = _checked(model, target)
        by_layer.setdefault(layer, set()).update(experts)
    if positions is not None:
        positions = indices(positions, "positions")
    hooks = []
    for layer in sorted(layer for layer, experts in by_layer.items() if SHARED in experts):
        if mode == "reroute":
            raise ValueError(f"block {layer}'s shared experts are not routed, so 'reroute' cannot remove them; use mode 'zero'")
        hooks += _zero_shared(layer, positions)
        by_layer[layer].discard(SHARED)
    for layer, experts in sorted(by_layer.items()):
        if not experts:  # only the shared experts were named
            continue
        if mode == "reroute" and model.cfg.moe.n_experts - len(experts) < model.cfg.moe.n_experts_per_token:
            raise ValueError(f"rerouting around {len(experts)} of block {layer}'s {model.cfg.moe.n_experts} experts leaves "
                             f"fewer than the {model.cfg.moe.n_experts_per_token} each token needs; remove fewer, or use mode 'zero'")
        hooks += (_zero if mode == "zero" else _reroute)(layer, tuple(sorted(experts)), positions)
    return hooks

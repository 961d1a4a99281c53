"""Expert ablation (lenskit.intervene.experts) on each MoE family, against hand computations: "zero" removes exactly
the expert's weighted output, "reroute" is the routing rule run by hand without the expert, then the experts."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_hf_family
from fixtures import random_tokens

from lenskit import HookedTransformer
from lenskit.intervene.experts import Expert, expert_ablation_hooks
from lenskit.intervene.interventions import ablation_hooks

MOE_FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"]
EVERY_HOOK = lambda name: True  # noqa: E731


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def model(request) -> HookedTransformer:
    return HookedTransformer.from_hf(make_hf_family(request.param, seed=4))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return random_tokens(3, 17, seed=8)


@pytest.fixture(scope="module")
def clean(model, tokens):
    return model.run_with_cache(tokens, names_filter=EVERY_HOOK)[1]


def hook(layer: int, name: str) -> str:
    return f"blocks.{layer}.mlp.hook_{name}"


def route_by_hand(logits: list[float], k: int, rule: str) -> tuple[list[int], list[float]]:
    """The experts and weights of one token, from its router logits (-inf: an expert that is not there)."""
    order = sorted(range(len(logits)), key=lambda j: -logits[j])[:k]
    pool = order if rule == "topk_softmax" else range(len(logits))  # which experts the softmax runs over
    top = max(logits)
    z = sum(math.exp(logits[j] - top) for j in pool)
    weights = [math.exp(logits[j] - top) / z for j in order]
    if rule == "softmax_topk_renorm":
        weights = [w / sum(weights) for w in weights]
    return order, weights


@pytest.mark.parametrize("expert", [1, [0, 2]], ids=["one", "two"])
def test_zero_removes_exactly_the_experts_weighted_output(model, tokens, clean, expert):
    layer, experts = 0, [expert] if isinstance(expert, int) else expert
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK,
                                    fwd_hooks=expert_ablation_hooks(model, Expert(layer, expert), "zero"))
    chosen, weights = clean[hook(layer, "expert_indices")], clean[hook(layer, "expert_weights")]
    hit = torch.isin(chosen, torch.tensor(experts))
    assert hit.any() and (~hit).any()
    removed = (weights * hit).unsqueeze(-1) * clean[hook(layer, "expert_out")]  # [batch, pos, k, d_model]
    torch.testing.assert_close(cache["mlp_out", layer], clean["mlp_out", layer] - removed.sum(2), atol=1e-5, rtol=0)
    assert torch.equal(cache[hook(layer, "expert_indices")], chosen)  # the routing is as it was
    assert torch.equal(cache[hook(layer, "expert_weights")], weights.masked_fill(hit, 0))  # the others' weights too
    assert torch.equal(cache["resid_pre", layer], clean["resid_pre", layer])


def test_reroute_is_the_routing_rule_without_the_expert(model, tokens, clean):
    layer, gone, k = 0, 2, model.cfg.moe.n_experts_per_token
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK,
                                    fwd_hooks=expert_ablation_hooks(model, [Expert(layer, gone)], mode="reroute"))
    x, logits = clean[f"blocks.{layer}.ln2.hook_normalized"], clean[hook(layer, "router_logits")]
    experts = model.blocks[layer].mlp.experts
    assert (clean[hook(layer, "expert_indices")] == gone).any()
    want = torch.zeros_like(x)
    with torch.no_grad():
        for b in range(x.shape[0]):
            for p in range(x.shape[1]):
                row = [float("-inf") if j == gone else v for j, v in enumerate(logits[b, p].tolist())]
                order, weights = route_by_hand(row, k, model.cfg.moe.routing)
                assert gone not in order
                assert cache[hook(layer, "expert_indices")][b, p].tolist() == order
                want[b, p] = sum(w * experts[j](x[b, p][None])[0] for j, w in zip(order, weights))
    torch.testing.assert_close(cache["mlp_out", layer], want, atol=1e-5, rtol=0)


def test_positions_restrict_either_mode(model, tokens):
    writes = lambda n: n.endswith("hook_mlp_out")  # noqa: E731 - the same path as the clean run: no expert_out
    _, clean = model.run_with_cache(tokens, names_filter=writes)
    for mode in ("zero", "reroute"):
        _, cache = model.run_with_cache(tokens, names_filter=writes,
                                        fwd_hooks=expert_ablation_hooks(model, Expert(0, 0), mode, positions=[4]))
        changed = (cache["mlp_out", 0] - clean["mlp_out", 0]).abs().amax(dim=(0, 2))  # [pos]
        # Elsewhere only the grouping changes (an expert's matmul runs on other rows): float rounding, no more.
        assert changed[4] > 1e-4 and changed[[p for p in range(17) if p != 4]].max() <= 1e-6, mode


def test_bad_expert_targets_are_refused_by_name(model):
    n, k = model.cfg.moe.n_experts, model.cfg.moe.n_experts_per_token
    with pytest.raises(IndexError, match=f"expert {n} is out of range; block 0 has {n} experts"):
        expert_ablation_hooks(model, Expert(0, n))
    with pytest.raises(ValueError, match="unknown expert ablation mode 'mean'; expected one of zero, reroute"):
        expert_ablation_hooks(model, Expert(0, 1), mode="mean")
    with pytest.raises(ValueError, match=f"leaves fewer than the {k} each token needs"):
        expert_ablation_hooks(model, Expert(0, range(n - k + 1)), mode="reroute")
    with pytest.raises(TypeError, match="experts are ablated by lenskit.intervene.experts.expert_ablation_hooks"):
        ablation_hooks(model, [Expert(0, 1)])
    if model.cfg.moe.dense_layers:
        with pytest.raises(ValueError, match="block 1 of .* has no experts \\(a dense block of this mixture of experts\\)"):
            expert_ablation_hooks(model, Expert(1, 0))


def test_a_dense_model_has_no_experts_to_ablate():
    dense = HookedTransformer.from_hf(make_hf_family("llama"))
    with pytest.raises(ValueError, match=r"has no experts \(a dense model\)"):
        expert_ablation_hooks(dense, Expert(0, 0))


# ------------------------------------------------------------- DeepSeek V3's routing and shared experts, whole models
SHARED_FAMILIES = ["deepseek_v3", "glm4_moe"]


@pytest.fixture(scope="module", params=SHARED_FAMILIES)
def shared_model(request) -> HookedTransformer:
    return HookedTransformer.from_hf(make_hf_family(request.param, seed=4))


def test_ablating_the_shared_experts_leaves_the_routed_write_and_moves_the_rest(shared_model, tokens):
    """Expert(L, "shared") zeroes what every token's shared experts add to the block's write: mlp_out becomes the
    routed experts' sum alone, the blocks before are untouched and the logits move."""
    model, layer = shared_model, shared_model.cfg.moe.dense_layers[-1] + 1  # the first block with experts
    logits, clean = model.run_with_cache(tokens, names_filter=EVERY_HOOK)
    ablated_logits, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK,
                                                 fwd_hooks=expert_ablation_hooks(model, Expert(layer, "shared")))
    assert clean[hook(layer, "shared_out")].abs().amin(-1).min() > 0  # every token's shared experts wrote something
    assert cache[hook(layer, "shared_out")].abs().max() == 0
    torch.testing.assert_close(cache["mlp_out", layer], clean[hook(layer, "routed_out")], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache["resid_post", layer],
                               clean["resid_post", layer] - clean[hook(layer, "shared_out")], atol=1e-5, rtol=0)
    assert torch.equal(cache["resid_mid", layer], clean["resid_mid", layer])
    assert (ablated_logits - logits).abs().max() > 1e-3


def test_a_deepseek_reroute_is_the_rule_by_hand_without_the_expert(shared_model, tokens):
    """Rerouting under sigmoid routing: each token's experts and weights are the rule run by hand with the expert's
    logit at -inf (it is never chosen, whatever its correction bias), then the experts and the shared ones."""
    from test_moe import sigmoid_groups_by_hand

    model = shared_model
    moe, layer = model.cfg.moe, model.cfg.moe.dense_layers[-1] + 1
    _, clean = model.run_with_cache(tokens, names_filter=EVERY_HOOK)
    gone = clean[hook(layer, "expert_indices")].flatten().mode().values.item()  # the most chosen expert
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK,
                                    fwd_hooks=expert_ablation_hooks(model, Expert(layer, gone), mode="reroute"))
    mlp = model.blocks[layer].mlp
    x, logits = clean[f"blocks.{layer}.ln2.hook_normalized"], clean[hook(layer, "router_logits")]
    bias = mlp.e_score_correction_bias.tolist()
    want = torch.zeros_like(x)
    with torch.no_grad():
        for b in range(x.shape[0]):
            for p in range(x.shape[1]):
                row = [float("-inf") if j == gone else v for j, v in enumerate(logits[b, p].tolist())]
                order, weights = sigmoid_groups_by_hand(row, bias, moe.n_experts_per_token, moe.n_group, moe.topk_group,
                                                        moe.routing.endswith("_renorm"), moe.routed_scaling_factor)
                assert gone not in order and cache[hook(layer, "expert_indices")][b, p].tolist() == order
                want[b, p] = sum(w * mlp.experts[j](x[b, p][None])[0] for j, w in zip(order, weights))
    torch.testing.assert_close(cache[hook(layer, "routed_out")], want, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["mlp_out", layer], want + clean[hook(layer, "shared_out")], atol=1e-5, rtol=0)

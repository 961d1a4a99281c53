"""Mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE; lenskit.pieces.moe): the router and expert hooks against
transformers' own router, the identity mlp_out = Σ_k weight_k · expert_out_k, what makes each family itself
(Mixtral's window, Qwen3-MoE's dense blocks and norm_topk_prob, OLMoE's renormalisation), both checkpoint
spellings of the experts, the weight views, and the routing rules by hand, DeepSeek V3's (DeepSeek V3, GLM-4.5) among
them, alone and inside whole models.

Golden parity of the whole stream (tied and untied, padded batches, save_pretrained both ways) runs for these
families in test_families.py, through the registry.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_hf_family
from golden import assert_golden, hf_blocks, hf_module_outputs, max_diff
from safetensors import safe_open
from safetensors.torch import save_file

from lenskit import HookedTransformer
from lenskit.pieces.moe import MoE, softmax_topk, softmax_topk_renorm, topk_softmax
from lenskit.pieces.shared_experts import grouped_sigmoid_topk

MOE_FAMILIES = ["mixtral", "qwen3_moe", "olmoe"]
EVERY_HOOK = lambda name: True  # noqa: E731 - includes the on-request hook_expert_out


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def pair(request):
    hf = make_hf_family(request.param, seed=2)
    return hf, HookedTransformer.from_hf(hf)


def moe_layers(model) -> list[int]:
    return [i for i in range(model.cfg.n_layers) if model.cfg.is_moe_layer(i)]


def hf_routing(hf, tokens) -> dict[int, tuple]:
    """transformers' own router outputs per MoE block: (logits, weights, indices), each [token, ...]."""
    return hf_module_outputs(hf, tokens, "mlp.gate", keep=lambda router: hasattr(router, "top_k"))  # dense: no router


# ------------------------------------------------------------------------------------- router and expert hooks
def test_router_hooks_are_transformers_routing(pair, tokens):
    hf, model = pair
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK)
    batch, pos = tokens.shape
    k, n = model.cfg.moe.n_experts_per_token, model.cfg.moe.n_experts
    theirs = hf_routing(hf, tokens)
    assert sorted(theirs) == moe_layers(model) and moe_layers(model)
    for i, (logits, weights, indices) in theirs.items():
        ours = {p: cache[f"blocks.{i}.mlp.hook_{p}"] for p in ("router_logits", "expert_indices", "expert_weights")}
        assert ours["router_logits"].shape == (batch, pos, n)
        assert ours["expert_indices"].shape == ours["expert_weights"].shape == (batch, pos, k)
        assert ours["expert_indices"].dtype == torch.long
        assert max_diff(ours["router_logits"].flatten(0, 1), logits) <= 1e-5
        assert torch.equal(ours["expert_indices"].flatten(0, 1), indices)
        assert max_diff(ours["expert_weights"].flatten(0, 1), weights) <= 1e-6
        assert cache[f"blocks.{i}.mlp.hook_expert_out"].shape == (batch, pos, k, model.cfg.d_model)


def test_mlp_out_is_the_weighted_sum_of_the_expert_outputs(pair, tokens):
    _, model = pair
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK)
    for i in moe_layers(model):
        weights, out = cache[f"blocks.{i}.mlp.hook_expert_weights"], cache[f"blocks.{i}.mlp.hook_expert_out"]
        torch.testing.assert_close(cache["mlp_out", i], torch.einsum("bpk,bpkm->bpm", weights, out), atol=1e-6, rtol=0)
        # Each slot's output is its expert run on the block's input, computed here one token at a time.
        x, chosen = cache[f"blocks.{i}.ln2.hook_normalized"], cache[f"blocks.{i}.mlp.hook_expert_indices"]
        b, p, j = 1, 5, 1
        with torch.no_grad():
            want = model.blocks[i].mlp.experts[int(chosen[b, p, j])](x[b, p][None])[0]
        torch.testing.assert_close(out[b, p, j], want, atol=1e-6, rtol=0)


def test_expert_out_is_computed_only_on_request(pair, tokens):
    _, model = pair
    assert not any(n.endswith("hook_expert_out") for n in model.hook_names(None))
    fast = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_mlp_out"))[1]
    asked = model.run_with_cache(tokens, names_filter=EVERY_HOOK)[1]
    assert not any(n.endswith("hook_expert_out") for n in fast.keys())
    for i in moe_layers(model):
        torch.testing.assert_close(fast["mlp_out", i], asked["mlp_out", i], atol=1e-6, rtol=0)


def test_a_hook_on_the_expert_outputs_edits_the_write(pair, tokens):
    _, model = pair
    i = moe_layers(model)[0]
    _, clean = model.run_with_cache(tokens, names_filter=EVERY_HOOK)

    def first_slot_only(out, hook):
        out = out.clone()
        out[:, :, 1:] = 0
        return out

    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK,
                                    fwd_hooks=[(f"blocks.{i}.mlp.hook_expert_out", first_slot_only)])
    want = clean[f"blocks.{i}.mlp.hook_expert_weights"][..., :1, None] * clean[f"blocks.{i}.mlp.hook_expert_out"][:, :, :1]
    torch.testing.assert_close(cache["mlp_out", i], want.sum(2), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------- each family's own parts
def test_mixtral_sliding_window_bites(tokens):
    windowed = make_hf_family("mixtral")
    full = make_hf_family("mixtral", sliding_window=None)
    a_model, b_model = HookedTransformer.from_hf(windowed), HookedTransformer.from_hf(full)
    assert a_model.cfg.sliding_window == 5 < tokens.shape[1] and b_model.cfg.sliding_window is None
    assert_golden(a_model, windowed, tokens)
    with torch.no_grad():
        a, b = a_model(tokens), b_model(tokens)
    assert max_diff(a[:, :5], b[:, :5]) <= 1e-6 and max_diff(a[:, 5:], b[:, 5:]) > 1e-3


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm_topk_prob"])
def test_norm_topk_prob_both_ways(family, norm, tokens):
    hf = make_hf_family(family, norm_topk_prob=norm, seed=7)
    model = HookedTransformer.from_hf(hf)
    assert model.cfg.moe.routing == ("softmax_topk_renorm" if norm else "softmax_topk")
    assert_golden(model, hf, tokens)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_expert_weights"))
    sums = cache["blocks.0.mlp.hook_expert_weights"].sum(-1)
    assert (max_diff(sums, torch.ones_like(sums)) <= 1e-6) == norm  # renormalised, or the top-k share of one


@pytest.mark.parametrize("overrides, dense", [(dict(mlp_only_layers=[1]), (1,)),
                                              (dict(mlp_only_layers=[], decoder_sparse_step=2), (0, 2)),
                                              (dict(mlp_only_layers=[1], decoder_sparse_step=2), (0, 1, 2))])
def test_qwen3_moe_dense_blocks(overrides, dense, tokens):
    hf = make_hf_family("qwen3_moe", num_hidden_layers=3, **overrides)
    model = HookedTransformer.from_hf(hf)
    assert model.cfg.moe.dense_layers == dense
    for i, block in enumerate(model.blocks):
        assert isinstance(block.mlp, MoE) != (i in dense)
        if i in dense:  # the ordinary MLP at intermediate_size, beside experts of moe_intermediate_size
            assert block.mlp.W_in.shape == (32, 48) and "blocks.%d.mlp.hook_post" % i in model.hook_dict
        else:
            assert block.mlp.W_in.shape == (4, 32, 24)
    assert_golden(model, hf, tokens)


def test_olmoe_qk_norm_spans_the_whole_projection():
    model = HookedTransformer.from_hf(make_hf_family("olmoe"))
    c = model.cfg
    assert c.attention.qk_norm and not c.attention.qk_norm_per_head and c.norm_placement == "pre"
    assert model.blocks[0].attn.q_norm.weight.shape == (c.n_heads * c.d_head,)
    assert model.blocks[0].attn.k_norm.weight.shape == (c.n_kv_heads * c.d_head,)


# ------------------------------------------------------------------------------------- checkpoints and weights
def write_fused(hf, folder) -> None:
    """A folder holding transformers 5's in-memory tensors as they are (the fused 3-D experts)."""
    folder.mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf.config.to_dict()))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_both_expert_spellings_load_memory_mapped(family, tmp_path, tokens):
    hf = make_hf_family(family, tie_word_embeddings=False, seed=3)
    hf.save_pretrained(tmp_path / "hub")  # transformers writes the hub's per-expert names
    write_fused(hf, tmp_path / "fused")
    with safe_open(str(tmp_path / "hub" / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert any(".experts.0." in k for k in names) and not any("gate_up_proj" in k for k in names)
    for folder in ("hub", "fused"):
        model = HookedTransformer.from_pretrained(tmp_path / folder)
        assert model.weight_files is not None  # the weights are the file's pages, not copies
        expert = model.blocks[0].mlp.experts[1].fc_in.weight
        assert not expert.untyped_storage().resizable()  # mapped storage, not an owned copy
        assert_golden(model, hf, tokens)


def test_expert_weight_views_are_transformers_experts(pair, tokens):
    hf, model = pair
    m, n = model.cfg.moe.d_expert, model.cfg.moe.n_experts
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK)
    for i in moe_layers(model):
        experts, mlp = hf_blocks(hf)[i].mlp.experts, model.blocks[i].mlp
        assert mlp.W_gate.shape == mlp.W_in.shape == (n, 32, m) and mlp.W_out.shape == (n, m, 32)
        assert torch.equal(mlp.W_gate, experts.gate_up_proj[:, :m].transpose(1, 2))
        assert torch.equal(mlp.W_in, experts.gate_up_proj[:, m:].transpose(1, 2))
        assert torch.equal(mlp.W_out, experts.down_proj.transpose(1, 2))
        assert torch.equal(mlp.W_router, hf_blocks(hf)[i].mlp.gate.weight.T)
        assert not (mlp.b_in.any() or mlp.b_gate.any() or mlp.b_out.any()) and mlp.b_out.shape == (n, 32)
        # The views reproduce each slot's expert output: silu(x W_gate) * (x W_in) W_out.
        x, chosen = cache[f"blocks.{i}.ln2.hook_normalized"], cache[f"blocks.{i}.mlp.hook_expert_indices"]
        by_views = torch.einsum("bpkm,bpkmd->bpkd", torch.nn.functional.silu(torch.einsum("bpd,bpkdm->bpkm", x, mlp.W_gate[chosen]))
                                * torch.einsum("bpd,bpkdm->bpkm", x, mlp.W_in[chosen]), mlp.W_out[chosen])
        torch.testing.assert_close(by_views, cache[f"blocks.{i}.mlp.hook_expert_out"], atol=1e-5, rtol=0)
    if model.cfg.moe.dense_layers:
        with pytest.raises(ValueError, match=r"model.W_in cannot stack the blocks' mlp.W_in: their shapes differ"):
            model.W_in  # noqa: B018 - a MoE block and a dense one
    else:
        assert model.W_in.shape == (model.cfg.n_layers, n, 32, m)


# ------------------------------------------------------------------------------------- the routing rules by hand
def test_routing_rules_by_hand():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    p = [torch.e ** 2, 1.0, torch.e, torch.e ** -1]
    total = sum(p)
    w, i = softmax_topk(logits, 2)
    assert i.tolist() == [[0, 2]] and w[0].tolist() == pytest.approx([p[0] / total, p[2] / total])
    w, i = softmax_topk_renorm(logits, 2)
    assert i.tolist() == [[0, 2]] and w[0].tolist() == pytest.approx([p[0] / (p[0] + p[2]), p[2] / (p[0] + p[2])])
    w, i = topk_softmax(logits, 2)  # the top two logits 2 and 1, then a softmax over them: the renormalised rule here
    assert i.tolist() == [[0, 2]] and w[0].tolist() == pytest.approx([1 / (1 + torch.e ** -1), 1 / (1 + torch.e)])
    assert w.dtype == torch.float32 and softmax_topk(logits.bfloat16(), 2)[0].dtype == torch.float32


def sigmoid_groups_by_hand(logits: list[float], bias: list[float], k: int, n_group: int, topk_group: int,
                           renorm: bool, scaling: float) -> tuple[list[int], list[float]]:
    """One token's experts (best choice first) and weights under DeepSeek V3's rule, in plain Python floats: sigmoid
    scores; the correction bias added for the choice alone; each group scored by its two best choices and only the
    topk_group best groups open; the k best choices among their experts, weighted by their scores (over their sum,
    with `renorm`) times `scaling`. A -inf logit (an expert taken away) is never chosen."""
    inf = float("inf")
    score = [0.0 if v == -inf else 1 / (1 + math.exp(-v)) for v in logits]
    choice = [-inf if v == -inf else s + b for v, s, b in zip(logits, score, bias)]
    size = len(logits) // n_group
    group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
    open_groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
    chosen = sorted((j for j in range(len(logits)) if j // size in open_groups), key=lambda j: -choice[j])[:k]
    weights = [score[j] for j in chosen]
    total = sum(weights) if renorm else 1.0
    return chosen, [w / total * scaling for w in weights]


@pytest.mark.parametrize("n_experts, k, n_group, topk_group, renorm, scaling", [
    (16, 4, 4, 2, True, 2.5),  # DeepSeek V3's shape in small: half the groups open, renormalised, scaled
    (8, 2, 1, 1, False, 1.0),  # GLM-4.5-Air's: one group, scores as they are
    (16, 3, 8, 3, True, 1.5),  # groups of two: a group's score is its whole sum
])
def test_deepseek_routing_is_the_rule_by_hand(n_experts, k, n_group, topk_group, renorm, scaling):
    g = torch.Generator().manual_seed(n_experts + k)
    logits, bias = torch.randn(64, n_experts, generator=g), 0.3 * torch.randn(n_experts, generator=g)
    weights, indices = grouped_sigmoid_topk(logits, k, bias, n_group, topk_group, renorm, scaling)
    unbiased = grouped_sigmoid_topk(logits, k, torch.zeros(n_experts), n_group, topk_group, renorm, scaling)[1]
    assert weights.dtype == torch.float32 and indices.shape == weights.shape == (64, k)
    for row, chosen, w in zip(logits.tolist(), indices.tolist(), weights.tolist()):
        want, want_w = sigmoid_groups_by_hand(row, bias.tolist(), k, n_group, topk_group, renorm, scaling)
        assert chosen == want and w == pytest.approx(want_w, rel=1e-6)
    assert not torch.equal(indices, unbiased)  # the bias moved some token's choice
    if n_group > 1:  # and the group limit passed over some token's globally best experts
        assert not torch.equal(indices.sort(-1).values, (logits.sigmoid() + bias).topk(k).indices.sort(-1).values)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_deepseek_routed_models_hooks_are_the_rule_by_hand(family, tokens):
    """In a whole model: each token's router logits, through the block's correction bias and settings by hand, give
    the experts and weights its hooks record (what multiplies each expert's output)."""
    model = HookedTransformer.from_hf(make_hf_family(family, seed=2))
    moe = model.cfg.moe
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: "mlp.hook_" in n)
    for layer in moe_layers(model):
        bias = model.blocks[layer].mlp.e_score_correction_bias.tolist()
        assert any(bias)  # conftest's perturbation: a bias that steers
        logits = cache[f"blocks.{layer}.mlp.hook_router_logits"].flatten(0, 1).tolist()
        indices = cache[f"blocks.{layer}.mlp.hook_expert_indices"].flatten(0, 1).tolist()
        weights = cache[f"blocks.{layer}.mlp.hook_expert_weights"].flatten(0, 1).tolist()
        for row, chosen, w in zip(logits, indices, weights):
            want, want_w = sigmoid_groups_by_hand(row, bias, moe.n_experts_per_token, moe.n_group, moe.topk_group,
                                                  moe.routing.endswith("_renorm"), moe.routed_scaling_factor)
            assert chosen == want and w == pytest.approx(want_w, rel=1e-5)


def test_a_hook_routing_outside_the_experts_is_refused(tokens):
    model = HookedTransformer.from_hf(make_hf_family("mixtral"))
    with pytest.raises(ValueError, match=r"expert indices must lie in \[0, 4\)"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_expert_indices", lambda x, hook: x + 4)])


def test_a_cache_cast_to_another_dtype_keeps_the_expert_indices_integers(pair, tokens):
    _, model = pair
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: "mlp.hook_expert" in n, dtype=torch.bfloat16)
    assert cache["blocks.0.mlp.hook_expert_indices"].dtype == torch.long
    assert cache["blocks.0.mlp.hook_expert_weights"].dtype == torch.bfloat16


def test_short_names_reach_the_moe_hooks(pair, tokens):
    _, model = pair
    _, cache = model.run_with_cache(tokens, names_filter=EVERY_HOOK)
    for short in ("router_logits", "expert_indices", "expert_weights", "expert_out"):
        assert cache[short, 0] is cache[f"blocks.0.mlp.hook_{short}"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reading_expert_out_leaves_the_logits_bit_for_bit(pair, tokens, dtype):
    """Observing does not move the numbers: with a read-only hook on hook_expert_out the weighted sum is taken in the
    order of the unhooked run; an edit through it still reaches mlp_out. Three experts per token: with two, any order
    of the sum rounds alike."""
    hf, _ = pair
    model = HookedTransformer.from_hf(make_hf_family(hf.config.model_type, seed=2, num_experts_per_tok=3)).to(dtype)
    names = lambda n: n.endswith("mlp.hook_expert_out")  # noqa: E731
    seen = []
    with torch.no_grad():
        plain = model(tokens)
        read = model.run_with_hooks(tokens, fwd_hooks=[(names, lambda x, hook: seen.append(x))])
        zeroed = model.run_with_hooks(tokens, fwd_hooks=[(names, lambda x, hook: torch.zeros_like(x))])
    assert seen and torch.equal(read, plain)
    assert not torch.equal(zeroed, plain)

"""HookedTransformer against transformers' GPT-2 (golden parity), the stream identities (docs/architecture.md), and hooks.

The golden tests never skip: they build small random GPT-2s with transformers, so no download is needed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_hf_gpt2
from fixtures import unchanged_copy
from golden import ATOL, assert_golden, max_diff

from lenskit import HookedTransformer

CONFIGS = {
    "default": dict(),
    "odd-shapes": dict(n_layer=2, n_embd=48, n_head=3, vocab_size=67, n_inner=80, seed=1),
    # Larger weights push activations to O(1), where approximations (e.g. tanh vs erf GELU) differ visibly.
    "large-init": dict(n_layer=2, n_embd=32, n_head=4, vocab_size=89, seed=4, initializer_range=0.3),
    "untied-erf-gelu": dict(n_layer=2, n_embd=24, n_head=2, vocab_size=53, seed=2,
                            tie_word_embeddings=False, activation_function="gelu", layer_norm_epsilon=1e-6),
}


def noop(x, hook):
    return None


def no_hooks_left(model: HookedTransformer) -> bool:
    return not any(hp.has_hooks() for hp in model.hook_dict.values())


def count_sdpa(monkeypatch) -> list[int]:
    calls = [0]
    real = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    return calls


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    hf = make_hf_gpt2(**CONFIGS[request.param])
    return hf, HookedTransformer.from_hf(hf)


def batch_for(model: HookedTransformer, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, model.cfg.d_vocab, (3, 19), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ golden parity
@pytest.mark.parametrize("path", ["fused", "eager", "eager+result", "fused+result"])
def test_golden_parity(pair, path, monkeypatch):
    hf, model = pair
    tokens = batch_for(model)
    fwd_hooks = []
    if path.startswith("eager"):  # a hook on the pattern forces the hand-written attention
        fwd_hooks.append((lambda n: n.endswith("attn.hook_pattern"), unchanged_copy))
    if path.endswith("result"):  # per-head writes, summed back
        fwd_hooks.append((lambda n: n.endswith("attn.hook_result"), noop))
    calls = count_sdpa(monkeypatch)
    worst = assert_golden(model, hf, tokens, fwd_hooks=fwd_hooks)
    assert calls[0] == (model.cfg.n_layers if path.startswith("fused") else 0)
    assert worst <= ATOL
    assert no_hooks_left(model)


def test_plain_forward_matches_transformers(pair):
    hf, model = pair
    tokens = batch_for(model, seed=4)
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.shape == (3, 19, model.cfg.d_vocab)
    assert max_diff(ours, theirs) <= ATOL
    # One sequence, passed 1-D, equals its row in the batch: no leakage across the batch.
    with torch.no_grad():
        assert max_diff(model(tokens[1]), ours[1:2]) <= 1e-5


def test_zero_attn_out_matches_transformers_ablation(pair):
    hf, model = pair
    tokens = batch_for(model, seed=5)

    def zero_first(mod, args, out):
        return (torch.zeros_like(out[0]), *out[1:])

    handle = hf.transformer.h[1].attn.register_forward_hook(zero_first)
    try:
        with torch.no_grad():
            want = hf(tokens).logits
    finally:
        handle.remove()
    with torch.no_grad():
        got = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_attn_out", lambda x, hook: torch.zeros_like(x))])
        clean = model(tokens)
    assert max_diff(got, want) <= ATOL
    assert max_diff(got, clean) > 1e-3  # the ablation did something
    assert no_hooks_left(model)


def test_greedy_generation_matches_transformers(pair):
    hf, model = pair
    prompt = batch_for(model, seed=6)[:2, :7]
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                       pad_token_id=0)
    got = model.generate(prompt, max_new_tokens=6)
    assert got.shape == (2, 13)
    assert torch.equal(got, want)


# ---------------------------------------------------------------- identities
@pytest.fixture(scope="module")
def full_cache(model):
    tokens = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=lambda n: True)  # everything, hook_result too
    return tokens, logits, cache


def test_residual_identities(model, full_cache):
    tokens, logits, cache = full_cache
    n = model.cfg.n_layers
    for i in range(n):
        assert max_diff(cache["resid_mid", i], cache["resid_pre", i] + cache["attn_out", i]) <= 1e-6
        assert max_diff(cache["resid_post", i], cache["resid_mid", i] + cache["mlp_out", i]) <= 1e-6
        if i + 1 < n:
            assert torch.equal(cache["resid_post", i], cache["resid_pre", i + 1])
    embed = cache["hook_embed"] + cache["hook_pos_embed"]
    assert max_diff(cache["resid_pre", 0], embed) <= 1e-6
    with torch.no_grad():
        assert max_diff(model.unembed(model.ln_final(cache["resid_post", n - 1])), logits) <= 1e-5
    assert max_diff(cache["ln_final.hook_normalized"] @ model.unembed.weight.T, logits) <= 1e-5


def test_stop_at_layer_returns_the_stream(model, full_cache):
    tokens, _, cache = full_cache
    with torch.no_grad():
        for layer in range(model.cfg.n_layers):
            assert max_diff(model(tokens, stop_at_layer=layer), cache["resid_pre", layer]) <= 1e-6
        assert max_diff(model(tokens, stop_at_layer=model.cfg.n_layers), cache["resid_post", -1]) <= 1e-6
    with pytest.raises(ValueError, match="stop_at_layer"):
        model(tokens, stop_at_layer=model.cfg.n_layers + 1)


def test_pattern_rows_are_causal_distributions(model, full_cache):
    tokens, _, cache = full_cache
    pos = tokens.shape[1]
    above = torch.ones(pos, pos, dtype=torch.bool).triu(1)
    for i in range(model.cfg.n_layers):
        pattern = cache["pattern", i]  # [batch, head, query_pos, key_pos]
        assert pattern.shape == (2, model.cfg.n_heads, pos, pos)
        assert (pattern >= 0).all()
        assert max_diff(pattern.sum(-1), torch.ones(pattern.shape[:-1])) <= 1e-5
        assert (pattern[..., above] == 0).all()
        assert (cache["attn_scores", i][..., above] == float("-inf")).all()


def test_attention_internals_by_hand(model, full_cache):
    _, _, cache = full_cache
    cfg = model.cfg
    for i in range(cfg.n_layers):
        attn = model.blocks[i].attn
        x = cache[f"blocks.{i}.ln1.hook_normalized"]
        with torch.no_grad():
            q, k, v = (x @ attn.qkv.weight.T + attn.qkv.bias).split(cfg.d_model, dim=-1)
        shape = (*x.shape[:2], cfg.n_heads, cfg.d_head)
        for name, want in (("q", q), ("k", k), ("v", v)):
            assert max_diff(cache[name, i], want.reshape(shape)) <= 1e-5
        scores = torch.einsum("bqhd,bkhd->bhqk", cache["q", i], cache["k", i]) / math.sqrt(cfg.d_head)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        assert max_diff(cache["attn_scores", i][..., causal], scores[..., causal]) <= 1e-5
        z = torch.einsum("bhqk,bkhd->bqhd", cache["pattern", i], cache["v", i])
        assert max_diff(cache["z", i], z) <= 1e-5
        # hook_result summed over heads plus the output bias is the attention's write.
        result = cache["result", i]  # [batch, pos, head, d_model]
        assert result.shape == (*x.shape[:2], cfg.n_heads, cfg.d_model)
        with torch.no_grad():
            assert max_diff(result.sum(2) + attn.out.bias, cache["attn_out", i]) <= 1e-5
            assert max_diff(cache["z", i].flatten(2) @ attn.out.weight.T + attn.out.bias, cache["attn_out", i]) <= 1e-5


def test_mlp_hooks_by_hand(model, full_cache):
    _, _, cache = full_cache
    for i in range(model.cfg.n_layers):
        mlp = model.blocks[i].mlp
        with torch.no_grad():
            pre = cache[f"blocks.{i}.ln2.hook_normalized"] @ mlp.fc_in.weight.T + mlp.fc_in.bias
            assert max_diff(cache["pre", i], pre) <= 1e-5
            # GPT-2's gelu_new, written out.
            post = 0.5 * pre * (1 + torch.tanh(math.sqrt(2 / math.pi) * (pre + 0.044715 * pre**3)))
            assert max_diff(cache["post", i], post) <= 1e-5
            assert max_diff(cache["post", i] @ mlp.fc_out.weight.T + mlp.fc_out.bias, cache["mlp_out", i]) <= 1e-5


def test_layernorm_hooks_by_hand(model, full_cache):
    _, _, cache = full_cache
    eps = model.cfg.norm_eps
    norms = [(f"blocks.{i}.ln1", model.blocks[i].ln1, cache["resid_pre", i]) for i in range(model.cfg.n_layers)]
    norms += [(f"blocks.{i}.ln2", model.blocks[i].ln2, cache["resid_mid", i]) for i in range(model.cfg.n_layers)]
    norms.append(("ln_final", model.ln_final, cache["resid_post", -1]))
    for prefix, ln, x in norms:
        x = x.double()
        centred = x - x.mean(-1, keepdim=True)
        scale = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        assert cache[f"{prefix}.hook_scale"].shape == (*x.shape[:2], 1)
        assert max_diff(cache[f"{prefix}.hook_scale"], scale) <= 1e-6
        want = centred / scale * ln.weight.detach().double() + ln.bias.detach().double()
        assert max_diff(cache[f"{prefix}.hook_normalized"], want) <= 1e-5


# --------------------------------------------------------------------- hooks
def test_hook_that_raises_leaves_nothing_attached(model, tokens):
    with torch.no_grad():
        clean = model(tokens)

    def boom(x, hook):
        raise RuntimeError("hook failed on purpose")

    with pytest.raises(RuntimeError, match="on purpose"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_pre", noop), ("blocks.1.hook_mlp_out", boom)])
    assert no_hooks_left(model)
    with pytest.raises(RuntimeError, match="on purpose"):
        model.run_with_cache(tokens, fwd_hooks=[("blocks.2.attn.hook_pattern", boom)])
    assert no_hooks_left(model)
    with torch.no_grad():
        assert torch.equal(model(tokens), clean)


def test_with_block_that_raises_leaves_nothing_attached(model, tokens):
    with torch.no_grad():
        clean = model(tokens)
    with pytest.raises(ZeroDivisionError):
        with model.hooks(fwd_hooks=[(lambda n: True, noop), ("blocks.1.hook_attn_out", lambda x, h: x * 0)]):
            assert all(hp.has_hooks() for hp in model.hook_dict.values())
            1 / 0
    assert no_hooks_left(model)
    with torch.no_grad():
        assert torch.equal(model(tokens), clean)


def test_bad_hook_return_and_bad_targets_leave_nothing_attached(model, tokens):
    with pytest.raises(ValueError, match="blocks.0.hook_attn_out"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_attn_out", lambda x, h: x[:, :1])])
    assert no_hooks_left(model)
    # The first hook attaches, the second target is unknown: the first must be removed again.
    with pytest.raises(KeyError):
        model.run_with_hooks(tokens, fwd_hooks=[("hook_embed", noop), ("blocks.0.hook_nope", noop)])
    assert no_hooks_left(model)
    with pytest.raises(TypeError, match="not callable"):
        model.run_with_hooks(tokens, fwd_hooks=[("hook_embed", noop), ("hook_pos_embed", 3)])
    assert no_hooks_left(model)
    with pytest.raises(TypeError, match="hook name or a predicate"):
        model.run_with_hooks(tokens, fwd_hooks=[(3, noop)])
    assert no_hooks_left(model)
    with pytest.raises(TypeError, match="pairs"):  # a dict iterates over its keys: refuse it clearly
        model.run_with_hooks(tokens, fwd_hooks={"hook_embed": noop})
    assert no_hooks_left(model)


@pytest.mark.parametrize("call", ["run_with_hooks", "run_with_cache", "hooks"])
def test_unknown_hook_name_suggests_the_closest(model, tokens, call):
    bad = "blocks.1.hook_atn_out"
    with pytest.raises(KeyError, match=r"blocks\.1\.hook_atn_out.*did you mean 'blocks\.1\.hook_attn_out'"):
        if call == "run_with_hooks":
            model.run_with_hooks(tokens, fwd_hooks=[(bad, noop)])
        elif call == "run_with_cache":
            model.run_with_cache(tokens, names_filter=["hook_embed", bad])
        else:
            with model.hooks([(bad, noop)]):
                pass
    assert no_hooks_left(model)


def test_hook_edits_flow_downstream_and_hooks_see_names(model, tokens):
    seen = []

    def record(x, hook):
        seen.append(hook.name)

    with torch.no_grad():
        doubled = model.run_with_hooks(tokens, fwd_hooks=[(lambda n: n.endswith("resid_post"), record),
                                                          ("ln_final.hook_normalized", lambda x, h: 2 * x)])
        clean = model(tokens)
    assert seen == [f"blocks.{i}.hook_resid_post" for i in range(model.cfg.n_layers)]
    assert max_diff(doubled, 2 * clean) <= 1e-5  # the unembedding has no bias


def test_names_filter_forms(model, tokens):
    everything = list(model.hook_dict)
    _, cache = model.run_with_cache(tokens)
    assert set(cache) == {n for n in everything if not n.endswith("attn.hook_result")}
    _, cache = model.run_with_cache(tokens, names_filter="blocks.2.hook_resid_post")
    assert list(cache) == ["blocks.2.hook_resid_post"]
    wanted = ["blocks.1.attn.hook_pattern", "hook_embed"]
    _, cache = model.run_with_cache(tokens, names_filter=wanted)
    assert sorted(cache) == sorted(wanted)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_result"))
    assert sorted(cache) == [f"blocks.{i}.attn.hook_result" for i in range(model.cfg.n_layers)]
    _, cache = model.run_with_cache(tokens, names_filter=[])
    assert len(cache) == 0
    with pytest.raises(TypeError, match="str"):
        model.run_with_cache(tokens, names_filter=[3])
    assert no_hooks_left(model)


def test_hook_dict_covers_design_names(model):
    names = set(model.hook_dict)
    top = {"hook_embed", "hook_pos_embed", "ln_final.hook_scale", "ln_final.hook_normalized"}
    per_block = ["hook_resid_pre", "ln1.hook_scale", "ln1.hook_normalized", "attn.hook_q", "attn.hook_k",
                 "attn.hook_v", "attn.hook_z", "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_result",
                 "hook_attn_out", "hook_resid_mid", "ln2.hook_scale", "ln2.hook_normalized", "mlp.hook_pre",
                 "mlp.hook_post", "hook_mlp_out", "hook_resid_post"]
    want = top | {f"blocks.{i}.{h}" for i in range(model.cfg.n_layers) for h in per_block}
    assert want <= names
    assert all(hp.name == n for n, hp in model.hook_dict.items())


@pytest.mark.parametrize("device, dtype", [(None, torch.float64), ("cpu", None), ("cpu", torch.bfloat16)])
def test_run_with_cache_device_and_dtype(model, tokens, device, dtype):
    names = ["blocks.0.hook_resid_post", "blocks.1.attn.hook_pattern"]
    with torch.no_grad():
        ref_logits, ref = model.run_with_cache(tokens, names_filter=names)
        logits, cache = model.run_with_cache(tokens, names_filter=names, device=device, dtype=dtype)
    assert torch.equal(logits, ref_logits)  # converting the cache copy never touches the forward pass
    for n in names:
        t = cache[n]
        assert t.dtype == (dtype or torch.float32)
        assert t.device.type == (device or "cpu")  # "meta", which holds no values, is refused (test_state_lifetimes)
        assert max_diff(t, ref[n]) <= 1e-2 * max(1.0, ref[n].abs().max().item())


def test_cache_does_not_keep_graph(model, tokens):
    _, cache = model.run_with_cache(tokens, names_filter="blocks.0.hook_resid_post")
    assert not cache["resid_post", 0].requires_grad

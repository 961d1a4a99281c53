"""The KV cache (lenskit.kv_cache): a forward given a cache computes what a full forward computes at the new
positions, on every family (rotary with Llama 3 / YaRN / proportional scaling, NoPE blocks, learned positions,
sliding windows, sinks, soft-caps, keys as values, MoE, Gated DeltaNet); hooks see the new positions only; a failed
forward leaves the cache as it was; a frozen cache is read and not extended; and misuse is refused in one line.

The reference is the model's own forward on the whole sequence, which the golden tests hold to transformers.
"""

from __future__ import annotations

import pytest
import torch
from families import FAMILY_BUILDERS, build_family_model, family_model_of
from golden import rounding

from lenskit.kv_cache import DeltaNetState, KeyValues, KVCache
from lenskit.transformer_lens.past_key_value_caching import HookedTransformerKeyValueCache


def tokens(batch: int = 2, pos: int = 14, seed: int = 0) -> torch.Tensor:
    # 14 positions: past every tiny config's sliding window (5 or 6) and past a DeltaNet conv's width
    return torch.randint(1, 300, (batch, pos), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def stepped(model, toks: torch.Tensor, splits: list[int]) -> tuple[torch.Tensor, KVCache]:
    """Logits [batch, pos, d_vocab] of toks fed in pieces ending at `splits` (then one at a time) through one cache."""
    cache = KVCache(model.cfg, toks.shape[0])
    ends = splits + list(range(splits[-1] + 1, toks.shape[1] + 1))
    starts = [0] + ends[:-1]
    logits = [model(toks[:, a:b], past_kv_cache=cache) for a, b in zip(starts, ends)]
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("family", list(FAMILY_BUILDERS))
def test_cached_steps_give_the_full_forwards_logits(family):
    model = family_model_of(family).model
    toks = tokens()
    with torch.no_grad():
        want = model(toks)
    got, cache = stepped(model, toks, [4, 7])  # a prompt, a 3-token piece (queries after cached keys), then singles
    assert cache.n_pos == toks.shape[1]
    assert (got - want).abs().max().item() <= rounding(model, toks), family


@pytest.mark.parametrize("family", ["gpt2", "mistral", "gemma2", "gpt_oss", "qwen3_5_text", "gemma4_text"])
def test_the_eager_path_agrees_with_the_cache_too(family):
    """A hook on the pattern sends attention through the eager path (masks written out, soft-caps, sinks)."""
    model = family_model_of(family).model
    toks = tokens(pos=10)
    patterns = []
    with torch.no_grad():
        want = model(toks)
        with model.hooks([(lambda n: n.endswith("hook_pattern"), lambda x, hook: patterns.append(x.shape))]):
            got, _ = stepped(model, toks, [6])
    assert (got - want).abs().max().item() <= rounding(model, toks)
    if family != "qwen3_5_text" or patterns:
        assert patterns[-1][2:] == (1, 10)  # [batch, head, new query, every key so far]


def test_hooks_see_the_new_positions_only():
    model = family_model_of("llama").model
    seen: dict[str, list] = {}
    names = ["hook_embed", "blocks.0.hook_resid_post", "blocks.1.attn.hook_k", "blocks.1.attn.hook_rot_q",
             "blocks.1.attn.hook_attn_scores"]
    hooks = [(n, lambda x, hook: seen.setdefault(hook.name, []).append(tuple(x.shape))) for n in names]
    with model.hooks(hooks):
        stepped(model, tokens(pos=6), [4])
    d, kv = model.cfg.d_model, model.cfg.n_kv_heads
    assert seen["hook_embed"] == [(2, 4, d), (2, 1, d), (2, 1, d)]
    assert seen["blocks.0.hook_resid_post"] == [(2, 4, d), (2, 1, d), (2, 1, d)]
    assert [s[:3] for s in seen["blocks.1.attn.hook_k"]] == [(2, 4, kv), (2, 1, kv), (2, 1, kv)]
    assert [s[1] for s in seen["blocks.1.attn.hook_rot_q"]] == [4, 1, 1]
    assert [s[2:] for s in seen["blocks.1.attn.hook_attn_scores"]] == [(4, 4), (1, 5), (1, 6)]


def test_learned_positions_continue_from_the_cache():
    model = family_model_of("gpt2").model
    seen = []
    with model.hooks([("hook_pos_embed", lambda x, hook: seen.append(x[0].clone()))]):
        stepped(model, tokens(pos=5), [3])
    assert torch.equal(seen[1][0], model.pos_embed.weight[3]) and torch.equal(seen[2][0], model.pos_embed.weight[4])


def test_entries_hold_what_attention_reads():
    model = family_model_of("qwen3_5_text").model  # linear, full, linear
    _, cache = stepped(model, tokens(pos=6), [6])
    assert isinstance(cache[0], DeltaNetState) and isinstance(cache[1], KeyValues) and len(cache) == 3
    assert cache[1].keys.shape[:2] == (2, 6) and cache[1].values.shape[:2] == (2, 6)
    width = model.blocks[0].attn.conv_weight.shape[-1]
    assert cache[0].conv.shape[:2] == (2, width - 1) and cache[0].state.dtype == torch.float32


def test_a_frozen_cache_is_read_and_not_extended():
    model = family_model_of("mistral").model
    toks = tokens(pos=9)
    cache = KVCache(model.cfg, 2)
    with torch.no_grad():
        model(toks[:, :7], past_kv_cache=cache)
        cache.freeze()
        a = model(toks[:, 7:8], past_kv_cache=cache)
        b = model(toks[:, 7:9], past_kv_cache=cache)  # the same prefix again: the first step was not kept
        assert cache.n_pos == 7 and cache[0].n_pos == 7
        want = model(toks)
        cache.unfreeze()
        model(toks[:, 7:8], past_kv_cache=cache)
    assert cache.n_pos == 8
    assert (a[:, 0] - want[:, 7]).abs().max() <= rounding(model, toks)
    assert (b - want[:, 7:9]).abs().max() <= rounding(model, toks)


def test_a_failed_forward_leaves_the_cache_as_it_was():
    model = family_model_of("qwen3_5_text").model
    toks = tokens(pos=6)
    cache = KVCache(model.cfg, 2)
    with torch.no_grad():
        model(toks[:, :4], past_kv_cache=cache)
        saved = [e._saved() for e in cache.entries]

        def boom(x, hook):
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"), model.hooks([("blocks.2.hook_resid_pre", boom)]):
            model(toks[:, 4:5], past_kv_cache=cache)  # blocks 0 and 1 ran and extended their entries
        assert cache.n_pos == 4 and all(a is b for e, s in zip(cache.entries, saved) for a, b in zip(e._saved(), s))
        assert not any(hp.has_hooks() for hp in model.hook_dict.values())
        got = model(toks[:, 4:6], past_kv_cache=cache)
        want = model(toks)[:, 4:6]
    assert (got - want).abs().max() <= rounding(model, toks)


def test_a_forward_inside_a_hook_of_a_cached_forward_sees_no_cache():
    model = family_model_of("llama").model
    toks = tokens(pos=5)
    inner: list[torch.Tensor] = []

    def run_the_whole_text(x, hook):
        if not inner:
            inner.append(None)  # before the nested forward, whose own pass through this hook must not recurse
            inner[0] = model(toks)

    cache = KVCache(model.cfg, 2)
    with torch.no_grad():
        want = model(toks)
        model(toks[:, :4], past_kv_cache=cache)
        with model.hooks([("blocks.1.hook_resid_post", run_the_whole_text)]):
            step = model(toks[:, 4:], past_kv_cache=cache)
    assert torch.equal(inner[0], want) and cache.n_pos == 5
    assert (step[:, 0] - want[:, 4]).abs().max() <= rounding(model, toks)


def test_the_transformer_lens_name_makes_the_same_cache():
    model = family_model_of("gpt2").model
    toks = tokens(pos=6)
    cache = HookedTransformerKeyValueCache.init_cache(model.cfg, "cpu", 2)
    assert isinstance(cache, KVCache) and cache.batch_size == 2 and cache.device == torch.device("cpu")
    with torch.no_grad():
        model(toks[:, :5], past_kv_cache=cache)
        got = model(toks[:, 5:], past_kv_cache=cache)
        want = model(toks)[:, 5:]
    assert (got - want).abs().max() <= rounding(model, toks)


def test_misuse_is_refused_in_one_line():
    model = family_model_of("gpt2").model
    toks = tokens(pos=4)
    other = build_family_model("gpt2").model  # same config, other weights: its keys are not this model's
    cache = KVCache(model.cfg, 2)
    with torch.no_grad():
        model(toks, past_kv_cache=cache)
        cases = [
            (lambda: other(toks, past_kv_cache=cache), "made for another model"),
            (lambda: family_model_of("llama").model(toks, past_kv_cache=cache), "made for another model"),
            (lambda: model(toks[:1], past_kv_cache=cache), "holds 2 sequence"),
            (lambda: model(torch.ones(2, model.cfg.n_ctx - 3, dtype=torch.long), past_kv_cache=cache), "pass n_ctx=64"),
            (lambda: model(toks, past_kv_cache=cache, stop_at_layer=1), "stop_at_layer"),
            (lambda: model(toks, past_kv_cache={}), "must be a lenskit KVCache"),
            (lambda: KVCache(model.cfg, 0), "batch_size must be an integer >= 1"),
        ]
        for call, match in cases:
            with pytest.raises((ValueError, TypeError), match=match) as err:
                call()
            assert "\n" not in str(err.value)
    assert cache.n_pos == 4  # nothing refused touched it


def test_a_kv_sharing_block_stores_nothing_and_reads_its_sources_cache():
    model = family_model_of("gemma4_text").model
    shared = [layer for layer, source in enumerate(model.cfg.kv_source_layers) if source is not None]
    assert shared  # the tiny Gemma 4 shares keys (n_kv_shared_layers), so the steps above covered it
    toks = tokens(pos=9)
    with torch.no_grad():
        want = model(toks)
    got, cache = stepped(model, toks, [5])
    assert (got - want).abs().max().item() <= rounding(model, toks)
    for layer in range(model.cfg.n_layers):
        assert cache[layer].n_pos == (0 if layer in shared else 9)

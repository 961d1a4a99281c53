"""The forward's state is explicit (lenskit.pieces.forward_state): the KV cache, Gemma 4's per-layer inputs and shared
keys go down the call as an argument, and lenskit has one context variable, the calling thread's hooks
(lenskit.observe.hook_context). Observing keeps the numbers: a hook that only reads never moves the logits."""

from __future__ import annotations

import ast
import inspect
import threading
from pathlib import Path

import pytest
import torch
from conftest import make_hf_family, make_hf_gpt2
from fixtures import random_tokens, unchanged_copy
from golden import max_diff

from lenskit import HookedTransformer, KVCache
from lenskit.families import FAMILIES
from lenskit.observe.hook_context import HOOK_CONTEXT
from lenskit.pieces.attention import Attention
from lenskit.pieces.deltanet import GatedDeltaNet
from lenskit.pieces.kv_sharing import SharedKVAttention
from lenskit.pieces.layers import BLOCK_CLASSES, ParallelBlock, RescaledSandwichBlock

ROOT = Path(__file__).resolve().parents[1]


def gemma4() -> HookedTransformer:
    """The registry's tiny Gemma 4 over 3 blocks: per-layer inputs, and block 2 reading block 0's keys."""
    hf = make_hf_family("gemma4_text", **FAMILIES["gemma4_text"].tiny_3_blocks)
    return HookedTransformer.from_hf(hf)


MODELS = {"gpt2": lambda: HookedTransformer.from_hf(make_hf_gpt2()), "gemma4": gemma4,
          "qwen3_5": lambda: HookedTransformer.from_hf(make_hf_family("qwen3_5_text", **FAMILIES["qwen3_5_text"].tiny_3_blocks))}


def context_variables(path: Path) -> int:
    """How many `ContextVar(...)` constructions the module at `path` has."""
    calls = [node.func for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.Call)]
    return sum((isinstance(f, ast.Name) and f.id == "ContextVar") or (isinstance(f, ast.Attribute) and f.attr == "ContextVar")
               for f in calls)


def test_lenskit_has_one_context_variable_the_hooks():
    found = {p.relative_to(ROOT).as_posix(): n for p in (ROOT / "lenskit").rglob("*.py") if (n := context_variables(p))}
    assert found == {"lenskit/observe/hook_context.py": 1}


def test_the_state_is_in_every_signature_from_the_forward_to_attention():
    """A reader follows `tokens` down: forward -> run_blocks(x, ..., state) -> block(x, state) -> attn(x, state)."""
    for fn in (HookedTransformer.run_blocks, *(c.forward for c in (*BLOCK_CLASSES.values(), ParallelBlock,
               RescaledSandwichBlock, Attention, SharedKVAttention, GatedDeltaNet))):
        assert "state" in inspect.signature(fn).parameters, fn.__qualname__


@pytest.mark.parametrize("name", list(MODELS))
def test_threads_with_a_cache_each_generate_what_a_full_forward_gives(name):
    """Two threads feed one model token by token, each with its own KVCache, at once: each step's logits are the full
    forward's at that position, so neither thread's cache (or Gemma 4's per-layer inputs and shared keys) reaches the
    other's blocks."""
    model = MODELS[name]()
    prompts = [random_tokens(1, 12, seed=3), random_tokens(1, 12, seed=4)]
    with torch.no_grad():
        want = [model(p) for p in prompts]
    got: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    start = threading.Barrier(2)

    def run(i: int) -> None:
        cache = KVCache(model.cfg, batch_size=1)
        start.wait()
        with torch.no_grad():
            got[i].append(model(prompts[i][:, :4], past_kv_cache=cache))
            for p in range(4, 12):
                got[i].append(model(prompts[i][:, p:p + 1], past_kv_cache=cache))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        stepped = torch.cat(got[i], dim=1)  # [1, 12, d_vocab]
        torch.testing.assert_close(stepped, want[i], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "gemma4"])
def test_nothing_stays_behind_after_a_forward_raises(name):
    """A hook that raises inside a cached forward under run_with_cache: afterwards the calling context has no hooks,
    no recording and no cache position, the cache is as it was, and the next forward is the clean one."""
    model = MODELS[name]()
    tokens = random_tokens(1, 9, seed=5)
    cache = KVCache(model.cfg, batch_size=1)
    with torch.no_grad():
        clean = model(tokens)
        model(tokens[:, :5], past_kv_cache=cache)
    kept = [(e.keys, e.values) for e in cache.entries]  # a sharing block's are None: it reads its source's

    def boom(x, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        model.run_with_cache(tokens[:, 5:], past_kv_cache=cache, fwd_hooks=[("blocks.1.hook_resid_post", boom)])
    context = HOOK_CONTEXT.get()
    assert (context.fwd, context.bwd, context.recording, context.start) == (None, None, None, None)
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())
    assert cache.n_pos == 5 and all(e.keys is k and e.values is v for e, (k, v) in zip(cache.entries, kept))
    with torch.no_grad():
        assert torch.equal(model(tokens), clean)
        step = model(tokens[:, 5:], past_kv_cache=cache)
    torch.testing.assert_close(step, clean[:, 5:], atol=2e-5, rtol=1e-5)


def test_a_block_alone_runs_without_a_cache_and_gemma4s_refuses_naming_what_it_needs():
    model = MODELS["gpt2"]()
    x = torch.randn(1, 6, model.cfg.d_model)
    with torch.no_grad():
        assert torch.equal(model.blocks[0](x), model.run_blocks(x, 0, 1))
    with pytest.raises(RuntimeError, match=r"block 1's per-layer input is computed by the model's forward"):
        gemma4().blocks[1](torch.randn(1, 6, 32))


# ------------------------------------------------------------ a read-only hook keeps the numbers
READ_POINTS = {  # family -> hook points whose hooked path once computed the write another way
    "gpt2": ["blocks.1.ln1.hook_scale", "blocks.1.ln2.hook_normalized", "ln_final.hook_scale", "blocks.1.attn.hook_result"],
    "llama": ["blocks.1.ln1.hook_scale", "blocks.1.ln2.hook_normalized", "blocks.1.attn.hook_result"],
    "gemma3_text": ["blocks.1.ln1.hook_scale", "blocks.1.ln2_post.hook_scale", "blocks.1.attn.q_norm.hook_scale"],
}


def dense_and_experts() -> HookedTransformer:
    """The registry's tiny Gemma 4 with 26B-A4B's experts beside each dense MLP."""
    hf = make_hf_family("gemma4_text", enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8,
                        hidden_size_per_layer_input=0)
    return HookedTransformer.from_hf(hf)


CASES = [(f, p) for f, points in READ_POINTS.items() for p in points] + [("gemma4_moe", "blocks.1.mlp.hook_expert_out")]


@pytest.mark.parametrize(("family", "point"), CASES, ids=[f"{f}-{p}" for f, p in CASES])
def test_in_bf16_reading_a_point_leaves_the_logits_bit_for_bit(family, point):
    """A hook that only reads (also run_with_cache's) leaves every logit as the unhooked run gives it, in bf16 where
    two ways of computing round apart; a hook that returns a copy counts as an edit and may move them, by at most
    2e-2 (the eager path, the same function rounded otherwise)."""
    model = dense_and_experts() if family == "gemma4_moe" else HookedTransformer.from_hf(make_hf_family(family))
    model = model.to(torch.bfloat16)
    tokens = random_tokens(2, 11, seed=6)
    with torch.no_grad():
        fused = model(tokens)
        read = model.run_with_hooks(tokens, fwd_hooks=[(point, lambda x, hook: None)])
        cached, cache = model.run_with_cache(tokens, names_filter=[point])
        edited = model.run_with_hooks(tokens, fwd_hooks=[(point, unchanged_copy)])
    assert point in cache
    assert torch.equal(read, fused) and torch.equal(cached, fused)
    assert max_diff(edited.float(), fused.float()) <= 2e-2


def test_an_edit_of_the_scale_or_a_head_result_still_bites():
    """The fused output stands only where nothing changed: a scale doubled or a head's share zeroed reaches the logits."""
    model = MODELS["gpt2"]()
    tokens = random_tokens(1, 7, seed=8)

    def zero_head(x, hook):  # an edit in place
        x[:, :, 0] = 0

    with torch.no_grad():
        clean = model(tokens)
        doubled = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.ln1.hook_scale", lambda x, hook: 2 * x)])
        zeroed = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_result", zero_head)])
    assert max_diff(doubled, clean) > 1e-3 and max_diff(zeroed, clean) > 1e-3

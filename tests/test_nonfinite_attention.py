"""Non-finite values in attention: the fused kernel (`model(tokens)`) and the hooked path (`run_with_cache`, which
writes attention out by hand) give the same result, and it is the one transformers' eager attention gives:
a NaN propagates, it never turns into zeros.

The reference is transformers' own model of each family with the same non-finite value put in, compared on the
logits and on the per-head attention output of the block where it enters (`hook_z`; transformers' output
projection input), where some heads stay finite, so the comparison is not all-NaN against all-NaN.
"""

from __future__ import annotations

import pytest
import torch
from families import build_family_model
from fixtures import random_tokens
from golden import hf_attention, hf_blocks

from lenskit import HookedTransformer

FAMILIES = ["gpt2", "gpt_neox", "llama", "mistral", "qwen3", "olmo2", "phi3"]
LLAMA_LIKE = ["llama", "mistral", "qwen3", "olmo2"]  # separate k_proj modules
LAYER = 1


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return random_tokens(2, 9, seed=5, high=300, low=3)


def nan_site(hf, n_heads: int, d_head: int, which: str) -> tuple[torch.nn.Parameter, tuple[int, int]]:
    """The projection weight of block LAYER and the element that feeds dim 3 of query head 0 ("q") or of
    key/value head 0 ("k"), in the family's own layout."""
    attn = hf_attention(hf_blocks(hf)[LAYER])
    if hasattr(attn, "q_proj"):  # split projections, [out, in]
        return getattr(attn, f"{which}_proj").weight, (3, 2)
    if hasattr(attn, "c_attn"):  # GPT-2's Conv1D, [in, q | k | v]
        return attn.c_attn.weight, (2, 3 if which == "q" else n_heads * d_head + 3)
    if hasattr(attn, "query_key_value"):  # GPT-NeoX, rows [head, (q, k, v), d_head]
        return attn.query_key_value.weight, (3 if which == "q" else d_head + 3, 2)
    return attn.qkv_proj.weight, (3 if which == "q" else n_heads * d_head + 3, 2)  # Phi-3, rows [q | k | v]


def z_of(hf, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits and block LAYER's attention output before its projection, [batch, pos, head * d_head]."""
    attn = hf_attention(hf_blocks(hf)[LAYER])
    out_proj = getattr(attn, "o_proj", None) or getattr(attn, "c_proj", None) or attn.dense
    seen = {}
    handle = out_proj.register_forward_pre_hook(lambda mod, args: seen.__setitem__("z", args[0].detach().clone()))
    try:
        with torch.no_grad():
            logits = hf(tokens).logits
    finally:
        handle.remove()
    return logits, seen["z"]


def assert_same_values(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN at other places"
    assert torch.equal(got.isinf(), want.isinf()), f"{what}: inf at other places"
    assert torch.allclose(got.nan_to_num(0, 0, 0), want.nan_to_num(0, 0, 0), atol=1e-4), f"{what}: finite values differ"


@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_nan_weight_gives_nan_on_both_paths_as_in_transformers(family, which, tokens, tmp_path):
    pair = build_family_model(family)
    cfg = pair.model.cfg
    weight, at = nan_site(pair.hf, cfg.n_heads, cfg.d_head, which)
    with torch.no_grad():
        weight[at] = float("nan")
    pair.hf.save_pretrained(tmp_path)
    model = HookedTransformer.from_pretrained(tmp_path, check_finite=False)  # as a user loads a checkpoint they trust
    want_logits, want_z = z_of(pair.hf, tokens)
    z = f"blocks.{LAYER}.attn.hook_z"
    with torch.no_grad():
        fused = model(tokens)  # no hooks: the fused kernel's path
        fused_z = model.run_with_cache(tokens, names_filter=z)[1][z]  # hook_z alone keeps the fused path too
        hooked, cache = model.run_with_cache(tokens)  # every hook: attention written out by hand
    assert_same_values(fused, want_logits, "model(tokens)")
    assert_same_values(hooked, want_logits, "run_with_cache")
    for got in (fused_z, cache[z]):
        assert_same_values(got.flatten(2), want_z, "hook_z")
    assert want_z.isnan().any() and want_logits.isnan().all()
    if cfg.attention.qk_norm_per_head or not cfg.attention.qk_norm:  # OLMo 2 normalises q (k) over all heads at once: every head is NaN
        assert not want_z.isnan().all()  # some heads stay finite, so the NaN pattern is compared, not just "all NaN"


@pytest.mark.parametrize("family", LLAMA_LIKE)
def test_a_nan_key_spreads_as_transformers_spreads_it(family, tokens):
    """A NaN in one position's key: transformers adds its mask to the scores, so the NaN reaches every query of
    that head, the earlier ones included (NaN + mask is NaN); the hooked path here does the same."""
    pair = build_family_model(family)
    pos = 5

    def nan_key(out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[:, pos, 3] = float("nan")  # key/value head 0, dim 3
        return out

    k_proj = hf_attention(hf_blocks(pair.hf)[LAYER]).k_proj
    handle = k_proj.register_forward_hook(lambda mod, args, out: nan_key(out))
    try:
        want_logits, want_z = z_of(pair.hf, tokens)
    finally:
        handle.remove()

    def ours(x, hook):  # hook_k: [batch, pos, kv_head, d_head]
        return nan_key(x.flatten(2)).view_as(x)

    z = f"blocks.{LAYER}.attn.hook_z"
    with torch.no_grad():
        logits, cache = pair.model.run_with_cache(tokens, names_filter=z, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_k", ours)])
    assert_same_values(cache[z].flatten(2), want_z, "hook_z")
    assert_same_values(logits, want_logits, "logits")
    assert want_z[:, :pos].isnan().any()  # the earlier queries too: the case the mask's form decides
    cfg = pair.model.cfg
    if cfg.attention.qk_norm_per_head or not cfg.attention.qk_norm:  # OLMo 2's k norm spans every head: all of them are NaN there
        assert not want_z.isnan().all()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_finite_inputs_keep_the_fused_kernel(family, tokens, monkeypatch):
    """The check that sends non-finite q and k to the hand-written path must not send finite ones there."""
    import torch.nn.functional as F

    pair = build_family_model(family)
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        pair.model(tokens)
    assert len(calls) == pair.model.cfg.n_layers

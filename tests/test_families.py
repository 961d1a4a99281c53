"""Golden parity of every family against transformers' own class, and the stream identities. The registry and
saving in each family's layout: tests/test_families_saving.py.

Each family's tiny config (the registry's `tiny`, conftest.FAMILY_CONFIGS) exercises what makes it itself: partial rotary and
the parallel block (Pythia), GQA and llama3 rotary scaling (Llama), a sliding window shorter than the
prompt (Mistral), q/k/v biases (Qwen 2), per-head q/k norms with d_head != d_model / n_heads (Qwen 3).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import FAMILIES, make_hf_family
from families import NEVER_TIED
from fixtures import unchanged_copy
from golden import assert_golden, hf_attention, hf_blocks, max_diff

from lenskit import HookedTransformer
from lenskit.observe.resid import late_writes

ALL_HOOKS = lambda name: True  # noqa: E731 - every hook on: the eager attention path


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def pair(family):
    hf = make_hf_family(family, tie_word_embeddings=False)
    return hf, HookedTransformer.from_hf(hf)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_golden_fast_and_eager_paths(family, tied, tokens):
    hf = make_hf_family(family, tie_word_embeddings=tied)
    model = HookedTransformer.from_hf(hf)
    tied = tied and family not in NEVER_TIED
    assert model.cfg.family == family and model.cfg.tie_word_embeddings == tied
    assert (model.unembed.weight is model.embed.weight) == tied
    assert_golden(model, hf, tokens)  # fused sdpa: only residual hooks are attached
    assert_golden(model, hf, tokens, fwd_hooks=[(lambda n: n.endswith("hook_pattern"), unchanged_copy)])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("shards", [None, "3KB"], ids=["single-file", "sharded"])
def test_golden_through_save_pretrained(family, shards, tied, tmp_path, tokens):
    hf = make_hf_family(family, tie_word_embeddings=tied, seed=3)
    folder = tmp_path / family
    hf.save_pretrained(folder, **({"max_shard_size": shards} if shards else {}))
    assert (folder / "model.safetensors.index.json").exists() == bool(shards)
    assert_golden(HookedTransformer.from_pretrained(folder), hf, tokens)


def test_bf16_checkpoint_loads(family, tmp_path, tokens):
    folder = tmp_path / "bf16"
    make_hf_family(family, seed=4).to(torch.bfloat16).save_pretrained(folder)
    reference = getattr(transformers, type(make_hf_family(family)).__name__).from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    model = HookedTransformer.from_pretrained(folder)
    assert model.embed.weight.dtype == torch.float32
    assert_golden(model, reference, tokens)
    assert HookedTransformer.from_pretrained(folder, dtype="bfloat16").embed.weight.dtype == torch.bfloat16


def test_stream_identities(pair, tokens):
    _, model = pair
    logits, cache = model.run_with_cache(tokens, names_filter=ALL_HOOKS)
    for i in range(model.cfg.n_layers):
        pre, mid, post = (cache[f"blocks.{i}.hook_{p}"] for p in ("resid_pre", "resid_mid", "resid_post"))
        torch.testing.assert_close(mid, pre + cache[f"blocks.{i}.hook_attn_out"], atol=1e-6, rtol=0)
        late = sum(cache[f"blocks.{i}.hook_{w}"] for w in late_writes(model.hook_dict, i))  # Gemma 4's rescale_out
        torch.testing.assert_close(post, mid + cache[f"blocks.{i}.hook_mlp_out"] + late, atol=1e-6, rtol=0)
        if i + 1 < model.cfg.n_layers:
            assert torch.equal(post, cache[f"blocks.{i + 1}.hook_resid_pre"])
    last = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    torch.testing.assert_close(model.readout(last), logits, atol=1e-5, rtol=0)  # fused vs hooked final norm
    # The per-head writes and the head-summed output agree under every projection layout; where a norm
    # follows attention (Gemma, OLMo 2), hook_result is before it and hook_attn_out after it.
    block = model.blocks[0]
    summed = cache["blocks.0.attn.hook_result"].sum(2) + (0 if block.attn.out.bias is None else block.attn.b_O)
    write = block.ln1_post(summed) if hasattr(block, "ln1_post") else summed
    if "blocks.0.hook_mamba_out" in cache:  # Falcon-H1: the heads write hook_heads_out, the Mamba-2 mixer beside them the rest
        torch.testing.assert_close(write, cache["blocks.0.hook_heads_out"], atol=1e-5, rtol=0)
        write = write + cache["blocks.0.hook_mamba_out"]
    torch.testing.assert_close(write, cache["blocks.0.hook_attn_out"], atol=1e-5, rtol=0)


def test_hook_shapes_follow_gqa_and_the_family(pair, tokens):
    _, model = pair
    c = model.cfg
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0.attn."))
    batch, pos = tokens.shape
    if c.mla.kv_lora_rank is not None:  # latent attention (DeepSeek V3): q and k wider than v, rotated inside the piece
        d_qk = c.mla.qk_nope_head_dim + c.rope.dim
        assert cache["blocks.0.attn.hook_q"].shape == cache["blocks.0.attn.hook_k"].shape == (batch, pos, c.n_heads, d_qk)
        assert cache["blocks.0.attn.hook_kv_latent"].shape == (batch, pos, c.mla.kv_lora_rank)
        assert cache["blocks.0.attn.hook_k_rope"].shape == (batch, pos, c.rope.dim)
        assert cache["blocks.0.attn.hook_v"].shape == (batch, pos, c.n_heads, c.d_head)
        assert cache["blocks.0.attn.hook_z"].shape == (batch, pos, c.n_heads, c.d_head)
        assert "blocks.0.attn.hook_rot_q" not in model.hook_dict
        # every head's key ends with the one shared rotated part
        k = cache["blocks.0.attn.hook_k"]
        assert torch.equal(k[..., -c.rope.dim:], cache["blocks.0.attn.hook_k_rope"][:, :, None].expand_as(k[..., -c.rope.dim:]))
        return
    assert cache["blocks.0.attn.hook_q"].shape == (batch, pos, c.n_heads, c.d_head)
    assert cache["blocks.0.attn.hook_k"].shape == (batch, pos, c.n_kv_heads, c.d_head)
    assert cache["blocks.0.attn.hook_v"].shape == (batch, pos, c.n_kv_heads, c.d_head)
    assert cache["blocks.0.attn.hook_z"].shape == (batch, pos, c.n_heads, c.d_head)
    assert cache["blocks.0.attn.hook_pattern"].shape == (batch, c.n_heads, pos, pos)
    rotary = c.rotates(0)  # not where every block is without positions (Granite 4's "nope")
    assert ("blocks.0.attn.hook_rot_q" in model.hook_dict) == rotary
    assert ("hook_pos_embed" in model.hook_dict) == (c.positional == "learned")
    assert ("blocks.0.attn.q_norm.hook_normalized" in model.hook_dict) == (model.cfg.family in ("qwen3", "gemma3_text", "olmo2", "qwen3_moe", "olmoe", "olmo3", "qwen3_5_text", "gemma4_text", "apertus", "qwen3_next", "llama4_text", "glm4_moe"))
    if rotary:
        rot_q, q = cache["blocks.0.attn.hook_rot_q"], cache["blocks.0.attn.hook_q"]
        assert rot_q.shape == q.shape and cache["blocks.0.attn.hook_rot_k"].shape == cache["blocks.0.attn.hook_k"].shape
        # Position 0 is not rotated (only scaled, by YaRN's attention factor: gpt-oss, not OLMo 3's sliding block 0); later positions are
        # (after any q norm).
        from lenskit.pieces.rotary import attention_factor

        before = cache.get("blocks.0.attn.q_norm.hook_normalized", q).view_as(q)  # OLMo 2's spans the heads: [batch, pos, head * d_head]
        torch.testing.assert_close(rot_q[:, 0], before[:, 0] * attention_factor(c, local=c.layer_type(0) == "sliding"), atol=1e-6, rtol=0)
        assert max_diff(rot_q[:, 1:], before[:, 1:]) > 1e-3


def test_expected_family_pieces():
    expect = {"gpt_neox": dict(parallel_block=True, rotary_dim=4, fused_qkv=True),
              "llama": dict(n_kv_heads=2, rope_type="llama3", fused_qkv=False, norm="rmsnorm", mlp="swiglu"),
              "mistral": dict(sliding_window=5, n_kv_heads=2),
              "qwen2": dict(qkv_bias=True, out_bias=False), "qwen3": dict(qk_norm=True, d_head=16),
              "gemma2": dict(norm="rmsnorm_offset", mlp="geglu", norm_placement="sandwich", scale_embed=True, d_head=16,
                             query_pre_attn_scalar=24.0, attn_softcap=1.0, final_softcap=2.0, sliding_window=5,
                             layer_types=("sliding", "full"), qk_norm=False),
              "gemma3_text": dict(norm="rmsnorm_offset", norm_placement="sandwich", qk_norm=True, attn_softcap=None,
                                  final_softcap=2.0, layer_types=("sliding", "full"), rotary_base=10000.0,
                                  rope_type="linear", rope_factor=4.0, local_rotary_base=100.0),
              "olmo2": dict(norm_placement="post", qk_norm=True, qk_norm_per_head=False, norm="rmsnorm"),
              "phi3": dict(fused_qkv=True, mlp="swiglu_fused", rotary_dim=4, sliding_window=6, n_kv_heads=2),
              "olmo3": dict(norm_placement="post", qk_norm=True, qk_norm_per_head=False, sliding_window=5,
                            layer_types=("sliding", "full"), rope_type="yarn", rope_factor=4.0, rotary_base=10000.0,
                            local_rotary_base=100.0),
              "smollm3": dict(nope_layers=(1,), n_kv_heads=2, sliding_window=None, layer_types=None, rotary_base=2e6),
              "gemma4_text": dict(norm="rmsnorm", norm_placement="sandwich", qk_norm=True, v_norm=True, layer_scalar=True,
                                  query_pre_attn_scalar=1.0, final_softcap=2.0, layer_types=("sliding", "full"),
                                  sliding_window=5, d_head=16, full_d_head=24, n_kv_heads=2, full_n_kv_heads=1,
                                  full_k_is_v=True, rope_type="proportional", rope_proportion=0.25, rotary_base=10000.0,
                                  local_rotary_base=100.0),
              "apertus": dict(qk_norm=True, qk_norm_per_head=True, mlp="gelu", activation="xielu", mlp_bias=False,
                              n_kv_heads=2, rope_type="llama3", rotary_base=12_000_000.0, rope_original_n_ctx=16),
              "llama4_text": dict(nope_layers=(1,), layer_types=("chunked", "full"), attn_chunk_size=5, qk_unit_norm=True,
                                  qk_norm=False, rope_adjacent_pairs=True, rope_type="llama3", attn_temperature_floor=3,
                                  attn_temperature_scale=0.5, routing="sigmoid_topk", n_shared_experts=1, dense_layers=(0,),
                                  d_mlp=48, d_expert=16, n_experts=4, n_experts_per_token=2)}
    for family, fields in expect.items():
        cfg = HookedTransformer.from_hf(make_hf_family(family)).cfg
        assert {k: getattr(cfg, k) for k in fields} == fields, family


def test_qk_norm_hooks_match_transformers(tokens):
    hf = make_hf_family("qwen3")
    model = HookedTransformer.from_hf(hf)
    seen = {}
    attn = hf_attention(hf_blocks(hf)[1])
    handle = attn.q_norm.register_forward_hook(lambda m, a, out: seen.__setitem__("q", out.detach()))
    try:
        with torch.no_grad():
            hf(tokens)
    finally:
        handle.remove()
    _, cache = model.run_with_cache(tokens, names_filter="blocks.1.attn.q_norm.hook_normalized")
    assert max_diff(cache["blocks.1.attn.q_norm.hook_normalized"], seen["q"]) <= 1e-5


def test_padded_batch_equals_each_prompt_alone(pair):
    _, model = pair
    gen = torch.Generator().manual_seed(5)
    lengths = [17, 9, 4]
    prompts = [torch.randint(3, 101, (n,), generator=gen) for n in lengths]
    batch = torch.full((3, 17), 2, dtype=torch.long)  # right-padded with an EOS id
    for row, p in enumerate(prompts):
        batch[row, : len(p)] = p
    with torch.no_grad():
        together = model(batch)
        for row, p in enumerate(prompts):
            gap = max_diff(together[row, : len(p)], model(p[None])[0])
            assert gap <= 1e-5, f"prompt {row} (length {len(p)}) differs by {gap:.3g} inside the padded batch"


def test_sliding_window_bites(tokens):
    windowed = HookedTransformer.from_hf(make_hf_family("mistral"))
    full = HookedTransformer.from_hf(make_hf_family("mistral", sliding_window=None))
    assert windowed.cfg.sliding_window == 5 < tokens.shape[1]
    with torch.no_grad():
        a, b = windowed(tokens), full(tokens)
    assert max_diff(a[:, :5], b[:, :5]) <= 1e-6  # within the window nothing changes
    assert max_diff(a[:, 5:], b[:, 5:]) > 1e-3  # past it, the window is applied, not ignored


def test_rope_parameters_and_legacy_spelling_agree():
    """transformers 4.x wrote rope_theta + rope_scaling at the top level; 5.x writes rope_parameters."""
    from lenskit import ModelConfig

    new = make_hf_family("llama").config.to_dict()
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    legacy["rope_theta"] = new["rope_parameters"]["rope_theta"]
    legacy["rope_scaling"] = {k: v for k, v in new["rope_parameters"].items() if k != "rope_theta"}
    assert ModelConfig.from_hf_config(new) == ModelConfig.from_hf_config(legacy)
    neox = make_hf_family("gpt_neox").config.to_dict()
    legacy = {k: v for k, v in neox.items() if k != "rope_parameters"} | {"rotary_pct": 0.5, "rotary_emb_base": 1000.0}
    assert ModelConfig.from_hf_config(neox) == ModelConfig.from_hf_config(legacy)


def test_gemma3_legacy_rope_spelling_agrees():
    """Gemma 3 configs on the hub spell rotary as rope_theta, rope_local_base_freq and rope_scaling (global
    blocks only), and the block pattern as sliding_window_pattern; transformers 5 writes per-layer-type settings."""
    from lenskit import ModelConfig

    new = make_hf_family("gemma3_text").config.to_dict()
    legacy = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(rope_theta=10000.0, rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                  sliding_window_pattern=2)
    assert ModelConfig.from_hf_config(new) == ModelConfig.from_hf_config(legacy)


# ----------------------------------------------------------- Gemma 2/3, OLMo 2, Phi-3: stream and readout
def test_logit_lens_at_the_last_stream_is_the_models_readout(pair, tokens):
    """The logit lens decodes through the model's whole readout (final norm, unembedding, any final soft-cap)."""
    from lenses import LogitLens

    _, model = pair
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=f"blocks.{model.cfg.n_layers - 1}.hook_resid_post")
        assert torch.equal(LogitLens(model)(cache.stream(model.cfg.n_layers), model.cfg.n_layers), logits)


# transformers' Gemma 3 never applies attn_logit_softcapping; lenskit refuses it there (test_config.REFUSED).
@pytest.mark.parametrize("family, cap", [("gemma2", "attn_logit_softcapping"), ("gemma2", "final_logit_softcapping"),
                                         ("gemma3_text", "final_logit_softcapping")])
def test_soft_caps_bite_and_match(family, cap, tokens):
    capped, uncapped = make_hf_family(family), make_hf_family(family, **{cap: None})
    with torch.no_grad():
        gap = max_diff(capped(tokens).logits, uncapped(tokens).logits)
    assert gap > 1e-2, f"{cap} too loose to change anything ({gap:.3g})"
    for hf in (capped, uncapped):
        model = HookedTransformer.from_hf(hf)
        assert (getattr(model.cfg, {"attn_logit_softcapping": "attn_softcap", "final_logit_softcapping": "final_softcap"}[cap])
                is None) == (hf is uncapped)
        assert_golden(model, hf, tokens)
    model = HookedTransformer.from_hf(capped)
    with torch.no_grad():
        assert model(tokens).abs().max() < model.cfg.final_softcap


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "olmo2"])
def test_post_sublayer_norm_hooks(family, tokens):
    model = HookedTransformer.from_hf(make_hf_family(family))
    _, cache = model.run_with_cache(tokens, names_filter=ALL_HOOKS)
    for i in range(model.cfg.n_layers):
        for sub, write in (("ln1_post", "attn_out"), ("ln2_post", "mlp_out")):
            assert cache[f"blocks.{i}.{sub}.hook_scale"].shape == (*tokens.shape, 1)
            assert torch.equal(cache[f"blocks.{i}.{sub}.hook_normalized"], cache[f"blocks.{i}.hook_{write}"])
    pre_norms = family != "olmo2"  # OLMo 2's sublayers read the raw stream
    assert ("blocks.0.ln1.hook_normalized" in model.hook_dict) == pre_norms
    assert ("blocks.0.ln2.hook_normalized" in model.hook_dict) == pre_norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_embedding_scale_as_transformers_rounds_it(dtype, tokens):
    hf = make_hf_family("gemma2").to(dtype)
    model = HookedTransformer.from_hf(hf)
    _, cache = model.run_with_cache(tokens, names_filter="hook_embed")
    with torch.no_grad():
        want = hf.model.embed_tokens(tokens)
    assert cache["hook_embed"].dtype == dtype and torch.equal(cache["hook_embed"], want)
    assert not torch.equal(cache["hook_embed"], model.embed.weight[tokens])


def test_gemma_blocks_alternate_window_and_rotary_base(tokens):
    """Block 0 is local (window 5, its own rotary base), block 1 global (full causal, linear-scaled rotary)."""
    from lenskit.pieces.attention import SlidingWindowMask

    model = HookedTransformer.from_hf(make_hf_family("gemma3_text"))
    local, glob = model.blocks[0].attn, model.blocks[1].attn
    assert isinstance(local.mask, SlidingWindowMask) and local.mask.window == 5 < tokens.shape[1]
    assert not isinstance(glob.mask, SlidingWindowMask)
    cos_local, _ = local.rotary.tables(4, torch.zeros(1))
    cos_glob, _ = glob.rotary.tables(4, torch.zeros(1))
    torch.testing.assert_close(cos_local[1, 0], torch.cos(torch.tensor(1.0)))  # fastest frequency is 1 at any base
    torch.testing.assert_close(cos_glob[1, 0], torch.cos(torch.tensor(0.25)))  # divided by the linear factor 4
    # A window longer than the prompt changes only what the local block may see, past position 5.
    wide = HookedTransformer.from_hf(make_hf_family("gemma3_text", sliding_window=64))
    with torch.no_grad():
        a, b = model(tokens), wide(tokens)
    assert max_diff(a[:, :5], b[:, :5]) <= 1e-5 and max_diff(a[:, 5:], b[:, 5:]) > 1e-3


def test_tuned_lens_step_through_a_final_soft_cap_equals_autograd(tokens):
    from references import autograd_kl

    from lenses import TunedLens
    from lenses.training import collect_streams
    from lenses.training.step import TranslatedStreams, kl_step
    from lenskit.pieces.readout import Readout

    model = HookedTransformer.from_hf(make_hf_family("gemma2"))
    for p in model.parameters():
        p.requires_grad_(False)
    lens = TunedLens(model)
    with torch.no_grad():
        for p in lens.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    streams, final = collect_streams(lens, tokens)
    reference = autograd_kl(lens, streams, final)
    (reference.sum() * 0.5).backward()
    expected = {k: p.grad.clone() for k, p in lens.named_parameters()}
    lens.zero_grad(set_to_none=True)
    kl = kl_step(TranslatedStreams(lens), model.readout, streams, final, scale=0.5, chunk_tokens=7)
    torch.testing.assert_close(kl, reference.double(), rtol=1e-5, atol=1e-5)
    for k, want in expected.items():
        assert want.abs().max() > 0, k
        torch.testing.assert_close(lens.get_parameter(k).grad, want, rtol=1e-4, atol=1e-7, msg=k)
    # Without the cap's derivative the step would be wrong: the uncapped readout gives another gradient.
    lens.zero_grad(set_to_none=True)
    kl_step(TranslatedStreams(lens), Readout(model.ln_final, model.unembed, None), streams, final, scale=0.5)
    assert any(max_diff(lens.get_parameter(k).grad, want) > 1e-4 for k, want in expected.items())


def test_direct_logit_attribution_is_to_the_pre_cap_logits(tokens):
    from lenses.anatomy import direct_logit_attribution

    model = HookedTransformer.from_hf(make_hf_family("gemma2"))
    logits, cache = model.run_with_cache(tokens, names_filter=ALL_HOOKS)
    frame = direct_logit_attribution(model, cache, token=5, minus=7)
    sums = frame.groupby("batch").attribution.sum().tolist()
    uncapped = model.readout_uncapped(cache.stream(model.cfg.n_layers))[:, -1]
    want = (uncapped[:, 5] - uncapped[:, 7]).tolist()
    assert frame.attrs["logit"] == pytest.approx(want, abs=1e-6) and sums == pytest.approx(want, abs=1e-4)
    capped = (logits[:, -1, 5] - logits[:, -1, 7]).tolist()
    assert max(abs(a - b) for a, b in zip(capped, want)) > 1e-3  # the cap bites here, and is not what is attributed
    with pytest.raises(ValueError, match="per_head"):
        direct_logit_attribution(model, cache, token=5, per_head=True)
    from lenses.anatomy import decompose_resid

    with pytest.raises(ValueError, match="ln1_post"):
        decompose_resid(cache, model.cfg.n_layers, per_head=True)
    parts = decompose_resid(cache, model.cfg.n_layers)  # whole writes, as added to the stream, sum to it
    torch.testing.assert_close(parts.total(), cache.stream(model.cfg.n_layers), atol=1e-4, rtol=0)


def test_fresh_gemma_norms_start_at_the_identity_gain():
    """(1 + w) norms are initialised with w = 0 (gain 1), the others with weight 1."""
    from lenskit import ModelConfig

    cfg = ModelConfig.from_name("gemma-3-1b").replace(n_layers=2, d_model=16, n_heads=2, n_kv_heads=1, d_head=8, d_mlp=24,
                                                      d_vocab=50, n_ctx=32, sliding_window=4, rotary_dim=8)
    model = HookedTransformer(cfg)
    for name in ("ln_final", "blocks.0.ln1", "blocks.0.ln1_post", "blocks.1.ln2_post", "blocks.0.attn.q_norm"):
        norm = model.get_submodule(name)
        assert torch.equal(norm.weight, torch.zeros_like(norm.weight)) and torch.equal(norm.gain, torch.ones_like(norm.gain))
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(model.ln_final(x), x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())

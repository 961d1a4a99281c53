"""Llama 4's own reading (golden parity of the tiny model, saving, presets' counts and every test above the model run
through the registry: test_families.py, test_families_saving.py, test_accounting.py): the published text configs read
as the presets; each of its pieces (chunked attention, the temperature of the blocks without rotary, the gainless q/k
norm, rotary on adjacent pairs, the MoE whose experts read the stream scaled by their score) changes the function and
is computed as transformers computes it; a prompt longer than the chunk generates as transformers' cached `generate`
does; and settings transformers refuses, or that lenskit does not implement, are refused by name."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import transformers
from conftest import make_hf_family
from golden import assert_golden, hf_module_outputs, max_diff

from lenskit import HookedTransformer, ModelConfig
from lenskit.intervene.experts import Expert, expert_ablation_hooks
from lenskit.pieces.attention import ChunkedMask, temperature
from lenskit.pieces.rotary import inverse_frequencies

_ROPE_BLOCKS = [int((i + 1) % 4 != 0) for i in range(48)]  # 1: the block rotates; every fourth does not
# meta-llama/Llama-4-Scout-17B-16E's config.json `text_config` (from memory, not downloaded): transformers 4's rotary
# spelling, the hub's own fields (for_llm_compressor, cache_implementation) beside transformers'
SCOUT = {
    "attention_bias": False, "attention_chunk_size": 8192, "attention_dropout": 0.0, "attn_scale": 0.1,
    "attn_temperature_tuning": True, "bos_token_id": 200000, "cache_implementation": "hybrid",
    "eos_token_id": [200001, 200007, 200008], "floor_scale": 8192, "for_llm_compressor": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02, "interleave_moe_layer_step": 1,
    "intermediate_size": 8192, "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760,
    "model_type": "llama4_text", "moe_layers": list(range(48)), "no_rope_layers": _ROPE_BLOCKS,
    "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48, "num_key_value_heads": 8,
    "num_local_experts": 16, "output_router_logits": False, "pad_token_id": 200018, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "torch_dtype": "bfloat16",
    "use_cache": True, "use_qk_norm": True, "vocab_size": 202048,
}
# meta-llama/Llama-4-Maverick-17B-128E's: 128 experts in every other block, no q/k norm, no rotary scaling
MAVERICK = {**SCOUT, "interleave_moe_layer_step": 2, "max_position_embeddings": 1048576, "moe_layers": list(range(1, 48, 2)),
            "num_local_experts": 128, "rope_scaling": None, "use_qk_norm": False}


@pytest.mark.parametrize("published, name", [(SCOUT, "llama-4-scout"), (MAVERICK, "llama-4-maverick")])
def test_the_published_text_configs_read_as_the_presets(published, name):
    read = ModelConfig.from_hf_config(published)
    preset = ModelConfig.from_name(name)
    assert dataclasses.replace(read, name=preset.name) == preset
    assert read.nope_layers == tuple(range(3, 48, 4)) and read.layer_type(3) == "full" and read.layer_type(0) == "chunked"
    theirs = transformers.Llama4TextConfig.from_dict({k: v for k, v in published.items() if k != "for_llm_compressor"})
    assert dataclasses.replace(ModelConfig.from_hf_config(theirs), name=preset.name) == preset
    assert [i for i in range(48) if read.is_moe_layer(i)] == theirs.moe_layers


def test_scouts_rotary_with_equal_frequency_factors_is_transformers():
    """Scout's Llama 3 scaling has high_freq_factor == low_freq_factor (no band between slowed and kept frequencies,
    the smoothing divides by zero there): the frequencies are still transformers'."""
    cfg = ModelConfig.from_name("llama-4-scout")
    with torch.device("meta"):
        hf_cfg = transformers.Llama4TextConfig.from_dict(SCOUT)
    theirs = transformers.models.llama4.modeling_llama4.Llama4TextRotaryEmbedding(hf_cfg).inv_freq
    ours = inverse_frequencies(cfg)
    assert torch.isfinite(ours).all() and torch.equal(ours, theirs)


# ------------------------------------------------------------------------------------- each piece bites
@pytest.mark.parametrize("off", [
    {"attention_chunk_size": None},  # every block full: the chunk (5 positions, of 17) is applied, not ignored
    {"attn_temperature_tuning": False},
    {"use_qk_norm": False},
    {"no_rope_layers": [1, 1]},  # block 1 rotates too
    {"interleave_moe_layer_step": 1},  # block 0 a MoE block as well
], ids=lambda off: next(iter(off)))
def test_each_piece_changes_the_function_and_is_computed_as_transformers_does(off, tokens):
    base = make_hf_family("llama4_text", seed=7)
    other = make_hf_family("llama4_text", seed=7, **off)
    assert_golden(HookedTransformer.from_hf(other), other, tokens)
    with torch.no_grad():
        assert max_diff(base(tokens).logits, other(tokens).logits) > 1e-3


def test_the_chunk_shorter_than_the_prompt_is_the_mask():
    """A query sees the earlier keys of its own chunk only, after cached keys as in one pass."""
    mask = ChunkedMask(3)
    full = mask.allowed(8, torch.device("cpu"))
    want = torch.tensor([[k <= q and k // 3 == q // 3 for k in range(8)] for q in range(8)])
    assert torch.equal(full, want)
    assert torch.equal(mask.allowed(3, torch.device("cpu"), start=5), full[5:])


def test_the_temperature_is_transformers_formula_by_hand():
    positions = torch.arange(20)
    want = [1 + 0.5 * math.log(1 + math.floor((p + 1) / 3)) for p in range(20)]
    torch.testing.assert_close(temperature(positions, 3, 0.5), torch.tensor(want), atol=1e-6, rtol=0)
    assert temperature(positions, 3, 0.5)[:2].eq(1).all()  # the first floor - 1 positions are untouched


def test_the_temperature_scales_the_queries_of_the_blocks_without_rotary_only(tokens):
    model = HookedTransformer.from_hf(make_hf_family("llama4_text"))
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.1.attn."))
    q, k = cache["blocks.1.attn.hook_q"], cache["blocks.1.attn.hook_k"].repeat_interleave(2, dim=2)
    scale = temperature(torch.arange(tokens.shape[1]), 3, 0.5)[None, None, :, None]  # [1, 1, query_pos, 1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale / math.sqrt(model.cfg.d_head)
    allowed = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()
    torch.testing.assert_close(cache["blocks.1.attn.hook_attn_scores"], scores.masked_fill(~allowed, -math.inf),
                               atol=1e-5, rtol=0)
    assert model.blocks[0].attn.temperature_tuning is None and model.blocks[1].attn.temperature_tuning == (3, 0.5)


def test_the_rotary_blocks_normalise_q_and_k_and_turn_adjacent_pairs(tokens):
    """Block 0's rotated q is each head's q divided by its RMS, then turned as complex pairs (q0 + i q1) e^{i p w}."""
    model = HookedTransformer.from_hf(make_hf_family("llama4_text"))
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0.attn."))
    q = cache["blocks.0.attn.hook_q"]
    normed = q / (q.pow(2).mean(-1, keepdim=True) + model.cfg.norm_eps).sqrt()
    angles = torch.outer(torch.arange(tokens.shape[1]).float(), inverse_frequencies(model.cfg))  # [pos, d_head / 2]
    turned = torch.view_as_real(torch.view_as_complex(normed.unflatten(-1, (-1, 2)).contiguous())
                                * torch.polar(torch.ones_like(angles), angles)[None, :, None]).flatten(-2)
    torch.testing.assert_close(cache["blocks.0.attn.hook_rot_q"], turned, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------- the experts
def test_routing_is_transformers_router_and_the_experts_read_the_scaled_stream(tokens):
    hf = make_hf_family("llama4_text", seed=2)
    model = HookedTransformer.from_hf(hf)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: "mlp" in n or n.endswith("ln2.hook_normalized"))
    (layer, (scores, logits)), = hf_module_outputs(hf, tokens, "feed_forward.router").items()
    assert layer == 1 and not model.cfg.is_moe_layer(0)
    indices, weights = cache["blocks.1.mlp.hook_expert_indices"], cache["blocks.1.mlp.hook_expert_weights"]
    assert max_diff(cache["blocks.1.mlp.hook_router_logits"].flatten(0, 1), logits) <= 1e-5
    # transformers' scores: the sigmoid at the chosen experts, 0 elsewhere
    torch.testing.assert_close(scores.gather(1, indices.flatten(0, 1)), weights.flatten(0, 1), atol=1e-6, rtol=0)
    assert torch.equal((scores > 0).sum(1), torch.full((indices[..., 0].numel(),), 2))
    # each slot's output is its expert on the stream times the slot's weight, by the weight views
    x = cache["blocks.1.ln2.hook_normalized"]
    mlp = model.blocks[1].mlp
    w_in, w_gate, w_out = mlp.W_in[indices], mlp.W_gate[indices], mlp.W_out[indices]  # [batch, pos, k, ...]
    scaled = x[:, :, None] * weights[..., None]  # [batch, pos, k, d_model]
    by_hand = torch.einsum("bpkm,bpkmd->bpkd", torch.nn.functional.silu(torch.einsum("bpkd,bpkdm->bpkm", scaled, w_gate))
                           * torch.einsum("bpkd,bpkdm->bpkm", scaled, w_in), w_out)
    torch.testing.assert_close(cache["blocks.1.mlp.hook_expert_out"], by_hand, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.1.mlp.hook_routed_out"], by_hand.sum(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(cache["blocks.1.hook_mlp_out"],
                               cache["blocks.1.mlp.hook_routed_out"] + cache["blocks.1.mlp.hook_shared_out"], atol=1e-6, rtol=0)
    # scaling the output instead of the input is another function: the test above could tell them apart
    assert max_diff(by_hand, weights[..., None] * torch.einsum(
        "bpkm,bpkmd->bpkd", torch.nn.functional.silu(torch.einsum("bpd,bpkdm->bpkm", x, w_gate))
        * torch.einsum("bpd,bpkdm->bpkm", x, w_in), w_out)) > 1e-4


def test_zeroing_an_expert_removes_exactly_its_slots_outputs(tokens):
    model = HookedTransformer.from_hf(make_hf_family("llama4_text", seed=2))
    names = lambda n: n.startswith("blocks.1.")  # noqa: E731
    _, clean = model.run_with_cache(tokens, names_filter=names)
    _, ablated = model.run_with_cache(tokens, names_filter=names, fwd_hooks=expert_ablation_hooks(model, [Expert(1, 3)]))
    hit = (clean["blocks.1.mlp.hook_expert_indices"] == 3)[..., None]
    assert hit.any()
    removed = (clean["blocks.1.mlp.hook_expert_out"] * hit).sum(2)
    torch.testing.assert_close(ablated["blocks.1.hook_mlp_out"], clean["blocks.1.hook_mlp_out"] - removed, atol=1e-5, rtol=0)
    _, shared_off = model.run_with_cache(tokens, names_filter=names, fwd_hooks=expert_ablation_hooks(model, [Expert(1, "shared")]))
    torch.testing.assert_close(shared_off["blocks.1.hook_mlp_out"], clean["blocks.1.mlp.hook_routed_out"], atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------- generation past the chunk
def test_cached_generation_across_chunks_is_transformers_cached_generate():
    """A 12-token prompt (chunks of 5) and 9 new tokens: the prompt's pass, then steps that enter new chunks, as
    transformers' cache (which keeps only the last chunk's keys for the chunked blocks) and mask compute them."""
    hf = make_hf_family("llama4_text", seed=4, vocab_size=300)
    hf.generation_config.eos_token_id = None
    model = HookedTransformer.from_hf(hf)
    tokens = torch.randint(1, 300, (2, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = hf.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=9, do_sample=False,
                           use_cache=True, pad_token_id=0)
    assert torch.equal(model.generate(tokens, 9, stop_at_eos=False), want)
    assert torch.equal(model.generate(tokens, 9, stop_at_eos=False, use_past_kv_cache=False), want)


# ------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("change, words", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attn_temperature_tuning": 4}, "attn_temperature_tuning"),  # transformers 5 types it bool and refuses 4 too
    ({"no_rope_layers": [1, 0]}, "no_rope_layers"),
    ({"layer_types": ["sliding_attention"] * 48}, "layer_types"),
    ({"attention_chunk_size": None, "layer_types": ["chunked_attention"] * 48}, "attention_chunk_size=None"),
    ({"moe_layers": [0, 48]}, "moe_layers"),
    ({"num_experts_per_tok": 17}, "num_experts_per_tok=17 exceeds num_local_experts=16"),
    ({"head_dim": None}, "head_dim"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}}, "rope_type='yarn'"),
])
def test_settings_outside_the_model_are_refused_by_name(change, words):
    with pytest.raises(ValueError, match=words) as e:
        ModelConfig.from_hf_config({**SCOUT, **change})
    assert "\n" not in str(e.value)


def test_the_multimodal_checkpoint_config_is_another_model_type():
    with pytest.raises(ValueError, match="model_type='llama4' is not supported") as e:
        ModelConfig.from_hf_config({"model_type": "llama4", "text_config": SCOUT})
    assert "\n" not in str(e.value) and "llama4_text" in str(e.value)



def test_lenskit_info_shows_scouts_total_and_active_parameters(capsys):
    """The total is transformers' meta-device model's (test_accounting.py); the active count is, by hand, everything
    but the 15 routed experts a token does not use in each of the 48 MoE blocks."""
    from lenses.cli import main

    assert main(["info", "--model", "llama-4-scout"]) in (0, None)
    out = capsys.readouterr().out
    d, m, vocab = 5120, 8192, 202048
    attn = 2 * d * 40 * 128 + 2 * d * 8 * 128
    block = attn + 2 * d + d * 16 + (16 + 1) * 3 * d * m  # norms, router, the routed experts and the shared one
    total = 2 * vocab * d + 48 * block + d
    active = total - 48 * 15 * 3 * d * m
    rows: dict[str, str] = {}
    for line in out.split("\nparameters\n", 1)[1].splitlines():  # the parameters table: its first rows of each name
        if line.split()[:1] in (["total"], ["active"]):
            rows.setdefault(line.split()[0], line.split()[1])
    assert rows["total"] == f"{total:,}" and rows["active"] == f"{active:,}"
    assert "chunked_blocks=36/48 (chunks of 8192)" in out and "attn_temperature=(floor 8192, scale 0.1)" in out


def test_transformer_lens_names_the_chunked_blocks_local(tmp_path):
    """TransformerLens's `attn_type`: "local" where a query does not see every earlier key (a chunk, as a window)."""
    import lenskit.transformer_lens as transformer_lens

    make_hf_family("llama4_text").save_pretrained(tmp_path)
    model = transformer_lens.HookedTransformer.from_pretrained_no_processing(str(tmp_path))
    assert [b.attn.attn_type for b in model.blocks] == ["local", "global"]


def test_weight_views_are_transformers_parameters():
    """The dense block's views are its feed_forward's; the MoE block's per-expert views are the fused `gate_up_proj`'s
    halves (gate first) and `down_proj`, as `x @ W`; the router's and the shared expert's are theirs."""
    hf = make_hf_family("llama4_text")
    model = HookedTransformer.from_hf(hf)
    dense, sparse = (block.feed_forward for block in hf.model.layers)
    ours = model.blocks[0].mlp
    assert torch.equal(ours.W_gate, dense.gate_proj.weight.T) and torch.equal(ours.W_in, dense.up_proj.weight.T)
    assert torch.equal(ours.W_out, dense.down_proj.weight.T) and ours.W_gate.shape == (32, 48)
    ours, m = model.blocks[1].mlp, model.cfg.moe.d_expert
    assert torch.equal(ours.W_gate, sparse.experts.gate_up_proj[..., :m])
    assert torch.equal(ours.W_in, sparse.experts.gate_up_proj[..., m:])
    assert torch.equal(ours.W_out, sparse.experts.down_proj) and torch.equal(ours.W_router, sparse.router.weight.T)
    assert torch.equal(ours.shared.W_gate, sparse.shared_expert.gate_proj.weight.T)
    assert torch.equal(ours.shared.W_in, sparse.shared_expert.up_proj.weight.T)
    assert torch.equal(ours.shared.W_out, sparse.shared_expert.down_proj.weight.T)


@pytest.mark.parametrize("change, words", [
    ({"mlp": "swiglu_clamped"}, "shared experts are dense MLPs of the experts. kind"),  # the shared expert's rule speaks first
    ({"attn_chunk_size": None}, "'chunked' blocks but attn_chunk_size is None"),
    ({"attn_temperature_floor": 0}, "attn_temperature_floor must be None or a positive int"),
    ({"qk_norm": True}, "qk_unit_norm and qk_norm"),
    ({"rotary_dim": 64}, "rope_adjacent_pairs turns whole heads"),
    ({"n_group": 2}, "n_group is a setting of DeepSeek's routing"),
])
def test_model_config_refuses_what_the_pieces_cannot_build(change, words):
    with pytest.raises(ValueError, match=words) as e:
        ModelConfig.from_name("llama-4-scout").replace(**change)
    assert "\n" not in str(e.value)

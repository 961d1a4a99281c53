"""Qwen 3.5 (`qwen3_5_text`) beyond the family-parametrised tests: prompts longer than the delta rule's chunk,
what a linear-attention block refuses (attention patterns, per-head results, head ablation and patching), the
gated attention's gate, the fields refused by name, and parameter counts against transformers' meta-device model."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from conftest import FAMILY_CONFIGS, make_hf_family
from golden import assert_golden, max_diff

from lenskit import PRESETS, HookedTransformer, ModelConfig, accounting
from lenskit.intervene.interventions import Attn, Head, ablation_hooks
from lenskit.intervene.patching import patching_hooks
from lenskit.pieces.deltanet import recurrent_gated_delta_rule

FAMILY = "qwen3_5_text"
LINEAR, FULL = 0, 1  # the 3-block model's kinds: linear, full, linear


@pytest.fixture(scope="module")
def pair():
    hf = make_hf_family(FAMILY, num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"])
    return hf, HookedTransformer.from_hf(hf)


@pytest.fixture(scope="module")
def long_tokens() -> torch.Tensor:
    return torch.randint(0, 101, (2, 150), generator=torch.Generator().manual_seed(3))  # 2 chunks and a part


def test_golden_beyond_one_chunk_and_the_recurrence_agrees(pair, long_tokens):
    hf, model = pair
    assert [type(b.attn).__name__ for b in model.blocks] == ["GatedDeltaNet", "Attention", "GatedDeltaNet"]
    assert_golden(model, hf, long_tokens)
    with torch.no_grad():
        chunked = model(long_tokens)
        try:
            for i in (0, 2):
                model.blocks[i].attn.rule = recurrent_gated_delta_rule
            assert max_diff(model(long_tokens), chunked) <= 1e-4  # logits; the layer itself agrees to 1e-5 (test_deltanet)
        finally:
            for i in (0, 2):
                del model.blocks[i].attn.rule  # back to the class's choice
    _, cache = model.run_with_cache(long_tokens)
    assert cache["blocks.0.hook_attn_out"].abs().max() > 0.1  # the linear blocks' writes are not negligible


def test_padded_batch_equals_each_prompt_alone_past_the_chunk(pair):
    _, model = pair
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 101, (n,), generator=gen) for n in (150, 70, 5)]
    batch = torch.full((3, 150), 2, dtype=torch.long)  # right-padded with an EOS id
    for row, p in enumerate(prompts):
        batch[row, : len(p)] = p
    with torch.no_grad():
        together = model(batch)
        for row, p in enumerate(prompts):
            assert max_diff(together[row, : len(p)], model(p[None])[0]) <= 1e-5


def test_linear_attention_hooks_and_the_state_on_request(pair, long_tokens):
    _, model = pair
    c = model.cfg
    _, cache = model.run_with_cache(long_tokens)
    assert "blocks.0.attn.hook_state" not in cache  # computed on request only
    batch, pos = long_tokens.shape
    assert cache["blocks.0.attn.hook_q"].shape == (batch, pos, c.linear.n_k_heads, c.linear.d_k)
    assert cache["blocks.0.attn.hook_v"].shape == (batch, pos, c.linear.n_v_heads, c.linear.d_v)
    assert cache["blocks.0.attn.hook_beta"].shape == cache["blocks.0.attn.hook_g"].shape == (batch, pos, c.linear.n_v_heads)
    _, cache = model.run_with_cache(long_tokens, names_filter=lambda n: n.startswith("blocks.0.attn."))
    state = cache["blocks.0.attn.hook_state"]
    assert state.shape == (batch, c.linear.n_v_heads, c.linear.d_k, c.linear.d_v)
    want = recurrent_gated_delta_rule(*(cache[f"blocks.0.attn.hook_{x}"] for x in ("q", "k", "v", "beta", "g")))[1]
    assert max_diff(state, want) <= 1e-5


def test_a_linear_block_has_no_pattern_and_says_so(pair, long_tokens):
    _, model = pair
    for ask in (lambda: model.run_with_cache(long_tokens, names_filter=["blocks.0.attn.hook_pattern"]),
                lambda: model.run_with_hooks(long_tokens, fwd_hooks=[("blocks.2.attn.hook_attn_scores", lambda x, h: None)])):
        with pytest.raises(KeyError, match=r"is a linear-attention \(Gated DeltaNet\) layer, which has no attention"):
            ask()
    assert "blocks.1.attn.hook_pattern" in model.hook_dict  # the full-attention block has one
    _, cache = model.run_with_cache(long_tokens, names_filter=lambda name: True)
    with pytest.raises(ValueError, match=r"stack_head_results: block 0 is a linear-attention .* no heads' writes"):
        cache.stack_head_results(2)
    with pytest.raises(ValueError, match="block 0 is a linear-attention"):
        ablation_hooks(model, [Head(0, 1)])
    with pytest.raises(ValueError, match="block 2 is a linear-attention"):
        patching_hooks(model, cache, "head", 2, heads=[0])
    ablation_hooks(model, [Attn(0), Head(1, 1)])  # the whole linear sublayer and a full block's head are fine


def test_the_output_gate_is_a_sigmoid_of_qs_projection_and_gates_z(pair, long_tokens):
    _, model = pair
    _, cache = model.run_with_cache(long_tokens, names_filter=lambda n: n.startswith("blocks.1."))
    gate = cache["blocks.1.attn.hook_gate"]
    assert gate.shape == cache["blocks.1.attn.hook_z"].shape and bool(((gate > 0) & (gate < 1)).all())
    shut = lambda x, hook: torch.zeros_like(x)  # noqa: E731
    _, cache = model.run_with_cache(long_tokens, names_filter="blocks.1.hook_attn_out",
                                    fwd_hooks=[("blocks.1.attn.hook_gate", shut)])
    assert cache["blocks.1.hook_attn_out"].abs().max() == 0
    attn = model.blocks[1].attn
    q_rows = attn.qkv.q.weight.view(attn.n_heads, 2, attn.d_head, -1)[:, 0]  # [head, d_head, d_model]
    assert torch.equal(attn.W_Q, q_rows.transpose(1, 2))


def _tiny(**changes) -> dict:
    config_cls, _, kwargs = FAMILY_CONFIGS[FAMILY]
    return {**getattr(transformers, config_cls)(**kwargs).to_dict(), **changes}


@pytest.mark.parametrize("changes, words", [
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(attn_output_gate=False), "attn_output_gate=False"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types="),
    (dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0)), "rope_type='linear'"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads=3"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section="11,11,10")), "mrope_section"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_interleaved="yes")), "mrope_interleaved"),
])
def test_fields_lenskit_does_not_implement_are_refused_by_name(changes, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig.from_hf_config(copy.deepcopy(_tiny(**changes)))


def test_full_attention_interval_places_the_full_blocks_as_transformers_does():
    d = {k: v for k, v in _tiny(num_hidden_layers=6, full_attention_interval=3).items() if k != "layer_types"}
    theirs = transformers.Qwen3_5TextConfig(**{k: v for k, v in d.items() if k != "model_type"}).layer_types
    assert theirs == ["linear_attention", "linear_attention", "full_attention"] * 2
    assert ModelConfig.from_hf_config(d).layer_types == ("linear", "linear", "full") * 2


@pytest.mark.parametrize("name", [n for n in sorted(PRESETS) if PRESETS[n].family == FAMILY])
def test_presets_count_what_transformers_builds(name):
    cfg = PRESETS[name]
    with torch.device("meta"):
        hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**{
            k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}))
        ours = HookedTransformer(cfg)
    total = sum(p.numel() for p in hf.parameters())
    head = 0 if cfg.tie_word_embeddings else hf.get_output_embeddings().weight.numel()
    s = accounting.param_summary(name)["value"]
    assert s["total"] == total == sum(p.numel() for p in ours.parameters())
    assert s["non_embedding"] == total - hf.get_input_embeddings().weight.numel() - head
    # FLOPs: 2 per weight of every matmul and of the convolution, per token; the delta rule's core does not grow
    weights = sum(p.numel() for n, p in ours.blocks.named_parameters() if p.ndim >= 2)
    short, long = (accounting.flops_per_token(name, n)["forward"] for n in (1024, 4096))
    assert short["attn_proj"] + short["mlp"] == 2 * weights
    per_token = 6 * cfg.linear.n_v_heads * cfg.linear.d_k * cfg.linear.d_v  # read k, update, read q: per block
    assert short["linear_core"] == long["linear_core"] == cfg.layer_types.count("linear") * per_token
    assert long["attn_core"] == 4 * short["attn_core"] > 0


def test_a_published_text_config_reads_as_its_preset():
    """Qwen/Qwen3.5-27B's `text_config` as published (with the fields transformers' causal LM ignores: the
    multi-token-prediction head, the state dtype of fast kernels, the MoE-only mlp_only_layers) reads as the preset."""
    published = {
        "model_type": "qwen3_5_text", "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "bos_token_id": None, "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
        "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_value_head_dim": 128,
        "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144, "mlp_only_layers": [], "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "num_attention_heads": 24, "num_hidden_layers": 64, "num_key_value_heads": 4,
        "pad_token_id": None, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10_000_000, "rope_type": "default"},
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
        "use_cache": True, "vocab_size": 248320,
    }
    assert ModelConfig.from_hf_config(published, name="qwen3.5-27b") == PRESETS["qwen3.5-27b"]

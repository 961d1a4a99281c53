"""Granite 4.0's own reading (golden parity, saving and every test above the model run through the registry:
test_families.py, test_families_saving.py): the published config.json files read as the presets, whose totals and
active counts equal transformers' own models built on the meta device; the muP scalars are where a researcher reads
them (`cfg.scales`, `hook_embed`, W_O and the per-head results, W_U) and every decomposition still sums to the stream;
the tuned-lens step through the logits' scale equals autograd; settings transformers runs differently are refused by
name."""

from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest
import torch
import transformers
from conftest import make_hf_family
from golden import assert_golden

from lenskit import HookedTransformer, ModelConfig, Stream, accounting
from lenskit.observe.resid import resid_parts

_H = ["mamba"] * 5 + ["attention"] + ["mamba"] * 4  # one attention block in ten, at 5, 15, 25, 35
_COMMON = {
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 100257, "eos_token_id": 100257, "pad_token_id": 100256,
    "hidden_act": "silu", "init_method": "mup", "initializer_range": 0.1, "max_position_embeddings": 131072,
    "normalization_function": "rmsnorm", "num_hidden_layers": 40, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "router_aux_loss_coef": 0.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 100352, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_d_conv": 4,
    "mamba_d_head": 64, "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_proj_bias": False,
}
# ibm-granite/granite-4.0-*'s config.json files (transformers 4 spelling), as recalled
PUBLISHED = {
    "granite-4.0-h-small": {
        **_COMMON, "attention_multiplier": 0.0078125, "embedding_multiplier": 12, "hidden_size": 4096,
        "intermediate_size": 768, "layer_types": _H * 4, "logits_scaling": 16, "mamba_n_heads": 128,
        "num_attention_heads": 32, "num_experts_per_tok": 10, "num_key_value_heads": 8, "num_local_experts": 72,
        "position_embedding_type": "nope", "residual_multiplier": 0.246, "rope_theta": 10000,
        "shared_intermediate_size": 768},
    "granite-4.0-h-tiny": {
        **_COMMON, "attention_multiplier": 0.0078125, "embedding_multiplier": 12, "hidden_size": 1536,
        "intermediate_size": 512, "layer_types": _H * 4, "logits_scaling": 6, "mamba_n_heads": 48,
        "num_attention_heads": 12, "num_experts_per_tok": 6, "num_key_value_heads": 4, "num_local_experts": 64,
        "position_embedding_type": "nope", "residual_multiplier": 0.22, "rope_theta": 10000,
        "shared_intermediate_size": 1024},
    "granite-4.0-h-micro": {
        **_COMMON, "attention_multiplier": 0.0078125, "embedding_multiplier": 12, "hidden_size": 2048,
        "intermediate_size": 8192, "layer_types": _H * 4, "logits_scaling": 8, "mamba_n_heads": 64,
        "num_attention_heads": 16, "num_experts_per_tok": 0, "num_key_value_heads": 4, "num_local_experts": 0,
        "position_embedding_type": "nope", "residual_multiplier": 0.246, "rope_theta": 10000,
        "shared_intermediate_size": 8192},
    "granite-4.0-micro": {
        **_COMMON, "attention_multiplier": 0.015625, "embedding_multiplier": 12, "hidden_size": 2560,
        "intermediate_size": 8192, "layer_types": ["attention"] * 40, "logits_scaling": 10, "mamba_n_heads": 128, "mamba_d_head": 40,
        "num_attention_heads": 40, "num_experts_per_tok": 0, "num_key_value_heads": 8, "num_local_experts": 0,
        "position_embedding_type": "rope", "residual_multiplier": 0.22, "rope_theta": 10000000,
        "shared_intermediate_size": 8192},
}
# The model cards' sizes: total and active parameters
CARDS = {"granite-4.0-h-small": (32e9, 9e9), "granite-4.0-h-tiny": (7e9, 1e9), "granite-4.0-h-micro": (3e9, 3e9),
         "granite-4.0-micro": (3e9, 3e9)}
NAMES = list(PUBLISHED)


@pytest.mark.parametrize("name", NAMES)
def test_the_published_config_reads_as_the_preset(name):
    read = ModelConfig.from_hf_config(PUBLISHED[name])
    preset = ModelConfig.from_name(name)
    assert dataclasses.replace(read, name=preset.name, initializer_range=preset.initializer_range) == preset
    published = PUBLISHED[name]
    assert read.scales.embedding == published["embedding_multiplier"]
    assert read.scales.residual == published["residual_multiplier"]
    assert read.scales.logits == 1 / published["logits_scaling"]
    assert read.attention.query_pre_attn_scalar ** -0.5 == published["attention_multiplier"]


def _meta_hf(name: str):
    config = {k: v for k, v in PUBLISHED[name].items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        return transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**config))


@pytest.mark.parametrize("name", NAMES)
def test_preset_totals_and_active_counts_equal_transformers_meta_model(name):
    hf = _meta_hf(name)
    total = sum(p.numel() for p in hf.parameters())  # the tied matrix once
    skipped = 0  # what a token skips: the experts it is not routed to, from transformers' own fused tensors
    for layer in hf.model.layers:
        if layer.has_experts:
            experts = layer.block_sparse_moe.experts
            n, k = experts.gate_up_proj.shape[0], hf.config.num_experts_per_tok
            skipped += (n - k) * (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel())
    s = accounting.param_summary(name)["value"]
    assert s["total"] == total
    active = s["active"] if "active" in s else s["total"]  # a dense model's: all of it
    assert active == total - skipped
    with torch.device("meta"):
        ours = HookedTransformer(ModelConfig.from_name(name))
    assert sum(p.numel() for p in ours.parameters()) == total
    card_total, card_active = CARDS[name]
    assert s["total"] == pytest.approx(card_total, rel=0.15)
    assert active - s["embed"] == pytest.approx(card_active, rel=0.5)  # the cards round 1.4B to "1B"


@pytest.mark.parametrize("change", [
    {"position_embedding_type": "rope"},  # rotary positions in the attention blocks
    {"num_local_experts": 0},  # H-Micro's dense form: the shared MLP alone, its neurons the MLP's
    {"mamba_n_groups": 2, "attention_bias": True},  # B and C per group of heads, the gated norm per group; biases
], ids=["rope", "dense", "groups-and-biases"])
def test_golden_variants(change, tokens, tmp_path):
    hf = make_hf_family("granitemoehybrid", **change)
    assert_golden(HookedTransformer.from_hf(hf), hf, tokens)
    hf.save_pretrained(tmp_path / "model")
    model = HookedTransformer.from_pretrained(tmp_path / "model")
    assert_golden(model, hf, tokens)
    model.save_pretrained(tmp_path / "ours")  # and back through our own files
    assert_golden(HookedTransformer.from_pretrained(tmp_path / "ours"), hf, tokens)


def test_info_reports_total_and_active_params():
    from lenses.cli import main as cli_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["info", "--model", "granite-4.0-h-small"]) == 0
    text, s = out.getvalue(), accounting.param_summary("granite-4.0-h-small")["value"]
    assert f"{s['total']:,}" in text and f"{s['active']:,}" in text and "active" in text
    assert "scales: embedding=12 residual=0.246 logits=0.0625" in text and "shared_experts=1 (d_shared=768)" in text


@pytest.fixture(scope="module")
def pair():
    hf = make_hf_family("granitemoehybrid", tie_word_embeddings=False)
    return hf, HookedTransformer.from_hf(hf)


ALL = lambda name: True  # noqa: E731 - hook_result and hook_expert_out too


def test_the_scalars_are_where_a_researcher_reads_them(pair):
    hf, model = pair
    config, scales = hf.config, model.cfg.scales
    assert (scales.embedding, scales.residual, scales.logits) == (
        config.embedding_multiplier, config.residual_multiplier, 1 / config.logits_scaling)
    tokens = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=ALL)
    # the stream starts as the embedding times embedding_multiplier: hook_embed is that start
    torch.testing.assert_close(cache["hook_embed"], model.W_E[tokens] * config.embedding_multiplier, atol=0, rtol=0)
    torch.testing.assert_close(cache["blocks.0.hook_resid_pre"], cache["hook_embed"], atol=0, rtol=0)
    for l, layer in enumerate(hf.model.layers):
        if layer.mamba is not None:  # the Mamba-2 mixer's out_proj writes times the multiplier too
            assert model.blocks[l].attn.out_proj.scale == config.residual_multiplier
        if layer.self_attn is not None:  # W_O is the write as it reaches the stream: o_proj times the multiplier
            o_proj = layer.self_attn.o_proj.weight.T.reshape(config.num_attention_heads, -1, config.hidden_size)
            torch.testing.assert_close(model.blocks[l].attn.W_O, o_proj * config.residual_multiplier)
            torch.testing.assert_close(cache["result", l].sum(-2) + model.blocks[l].attn.b_O, cache["attn_out", l],
                                       atol=1e-6, rtol=0)
        mlp = model.blocks[l].mlp  # the experts' and the shared MLP's writes, each after the multiplier
        torch.testing.assert_close(cache[f"blocks.{l}.mlp.hook_routed_out"] + cache[f"blocks.{l}.mlp.hook_shared_out"],
                                   cache["mlp_out", l], atol=1e-6, rtol=0)
        weights, out = cache[f"blocks.{l}.mlp.hook_expert_weights"], cache[f"blocks.{l}.mlp.hook_expert_out"]
        torch.testing.assert_close((weights[..., None] * out).sum(-2), cache[f"blocks.{l}.mlp.hook_routed_out"],
                                   atol=1e-6, rtol=0)
        torch.testing.assert_close(mlp.shared.W_out, layer.shared_mlp.output_linear.weight.T * config.residual_multiplier)
    # the logits are the unembedding's over logits_scaling, and W_U says so
    torch.testing.assert_close(model.W_U, hf.lm_head.weight.T / config.logits_scaling)
    normed = cache["ln_final.hook_normalized"]
    torch.testing.assert_close(normed @ model.W_U, logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.readout(cache.stream(model.cfg.n_layers)), logits, atol=0, rtol=0)
    torch.testing.assert_close(model.unembed(normed), logits, atol=0, rtol=0)  # TransformerLens's model.unembed


def test_the_decomposition_and_logit_attribution_sum_exactly(pair):
    _, model = pair
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=ALL)
        # every head of the attention blocks, the Mamba-2 blocks' and the MLPs' whole writes, the embedding
        parts = torch.stack([p.tensor for p in resid_parts(cache, Stream(model.cfg.n_layers), per_head=True)])
        attrs = cache.logit_attrs(cache.decompose_resid(), tokens[:, -1])
    torch.testing.assert_close(parts.sum(0), cache.stream(model.cfg.n_layers), atol=1e-5, rtol=0)
    expected = (cache["ln_final.hook_normalized"] * model.W_U[:, tokens[:, -1]].T[:, None]).sum(-1)
    torch.testing.assert_close(attrs.sum(0), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(expected, logits.gather(-1, tokens[:, -1, None, None].expand(-1, 7, 1))[..., 0],
                               atol=1e-5, rtol=0)


def test_the_tuned_lens_step_through_the_logits_scale_equals_autograd(pair):
    from lenses.training.step import readout_kl_and_grad

    _, model = pair
    g = torch.Generator().manual_seed(3)
    normed = torch.randn(2, 5, model.cfg.d_model, generator=g)
    target = torch.randn(5, model.cfg.d_vocab, generator=g)
    kl, grad = readout_kl_and_grad(normed, target, model.readout)
    x = normed.clone().requires_grad_(True)
    z = model.unembed(x).log_softmax(-1)  # the logits, over logits_scaling
    p = target.log_softmax(-1)
    want = (p.exp() * (p - z)).sum(-1).sum(-1)  # per stream
    want.sum().backward()
    torch.testing.assert_close(kl.float(), want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, x.grad, atol=1e-6, rtol=1e-5)


def test_folding_value_biases_keeps_the_function_under_the_residual_multiplier():
    # attention blocks only: the Mamba-2 piece refuses fold_value_biases by name (it has no values)
    hf = make_hf_family("granitemoehybrid", attention_bias=True, layer_types=["attention", "attention"])
    raw = HookedTransformer.from_hf(hf)
    processed = raw.process_weights(fold_ln=False, center_writing_weights=False, center_unembed=False,
                                    fold_value_biases=True)
    tokens = torch.randint(0, raw.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = raw(tokens).log_softmax(-1), processed(tokens).log_softmax(-1)
    assert (a - b).abs().max().item() < 1e-5
    assert not processed.b_V.any() and processed.b_O.abs().max() > 1e-3


_BASE = PUBLISHED["granite-4.0-micro"]


@pytest.mark.parametrize("change, words", [
    ({"position_embedding_type": "alibi"}, "position_embedding_type='alibi'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"normalization_function": "layernorm"}, "normalization_function='layernorm'"),
    ({"num_local_experts": 4, "num_experts_per_tok": 6}, "num_experts_per_tok=6 exceeds num_local_experts=4"),
    ({"layer_types": ["attention"] * 39}, "layer_types"),
    ({"layer_types": ["attention"] * 39 + ["sliding_attention"]}, "layer_types"),
    ({"layers_block_type": ["mamba"] * 40}, "layer_types and layers_block_type disagree"),
    ({"head_dim": 128}, "head_dim=128"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e7, "factor": 2.0}}, "rope_type"),
    ({"attention_multiplier": 0}, "attention_multiplier=0"),
    ({"logits_scaling": None}, "logits_scaling=None"),
    ({"residual_multiplier": -0.5}, "residual_multiplier=-0.5"),
    ({"embedding_multiplier": float("nan")}, "embedding_multiplier=nan"),
    ({"layer_types": ["mamba"] * 40, "mamba_n_heads": 128, "mamba_d_head": 64}, "mamba_n_heads=128 and mamba_d_head=64"),
    ({"layer_types": ["mamba"] * 40, "time_step_limit": [1.0, 0.5]}, "time_step_limit"),
])
def test_settings_outside_the_model_are_refused_by_name(change, words):
    with pytest.raises(ValueError, match=words) as e:
        ModelConfig.from_hf_config({**_BASE, **change})
    assert "\n" not in str(e.value)

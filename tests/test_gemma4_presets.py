"""The published Gemma 4 text sizes as presets (gemma-4-e2b, gemma-4-e4b, gemma-4-26b-a4b, beside gemma-4-31b):
their config.json read as the preset by both libraries, parameter counts equal to transformers' own models built on
the meta device (per-layer input tables as embeddings, active parameters of the mixture), FLOPs equal to torch's
counter on a shrunk copy, and `lenskit info`."""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
import transformers
from fixtures import unchanged_copy
from torch.utils.flop_counter import FlopCounterMode

from lenses.cli import main
from lenskit import PRESETS, HookedTransformer, ModelConfig, accounting


def _layer_types(n: int, pattern: int) -> list[str]:
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


_ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
         "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
_COMMON = {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "head_dim": 256, "global_head_dim": 512,
           "vocab_size": 262144, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
           "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
           "pad_token_id": 0, "use_bidirectional_attention": "vision", "rope_parameters": _ROPE}
# The text_config of each published config.json, as recalled (CI has no network), not downloaded; the totals below
# are transformers 5.24's own models of them, built on the meta device.
PUBLISHED = {
    "gemma-4-e2b": {**_COMMON, "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35,
                    "num_attention_heads": 8, "num_key_value_heads": 1, "attention_k_eq_v": False, "sliding_window": 512,
                    "max_position_embeddings": 131072, "hidden_size_per_layer_input": 256,
                    "vocab_size_per_layer_input": 262144, "num_kv_shared_layers": 20, "use_double_wide_mlp": True,
                    "enable_moe_block": False, "layer_types": _layer_types(35, 5)},
    "gemma-4-e4b": {**_COMMON, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 42,
                    "num_attention_heads": 8, "num_key_value_heads": 2, "attention_k_eq_v": False, "sliding_window": 512,
                    "max_position_embeddings": 131072, "hidden_size_per_layer_input": 256,
                    "vocab_size_per_layer_input": 262144, "num_kv_shared_layers": 18, "use_double_wide_mlp": False,
                    "enable_moe_block": False, "layer_types": _layer_types(42, 6)},
    "gemma-4-26b-a4b": {**_COMMON, "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30,
                        "num_attention_heads": 16, "num_key_value_heads": 8, "num_global_key_value_heads": 2,
                        "attention_k_eq_v": True, "sliding_window": 1024, "max_position_embeddings": 262144,
                        "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "enable_moe_block": True,
                        "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
                        "layer_types": _layer_types(30, 6)},
}
TOTALS = {"gemma-4-e2b": 4_628_569_344, "gemma-4-e4b": 7_463_013_376, "gemma-4-26b-a4b": 25_233_141_760}


def meta_model(name: str) -> torch.nn.Module:
    config = transformers.Gemma4TextConfig.from_dict(copy.deepcopy(PUBLISHED[name]))
    with torch.device("meta"):
        return transformers.Gemma4ForCausalLM(config)


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied matrix once


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_published_config_reads_as_the_preset_in_both_libraries(name):
    preset = ModelConfig.from_name(name)
    assert ModelConfig.from_hf_config(copy.deepcopy(PUBLISHED[name]), name=name) == preset
    theirs = transformers.Gemma4TextConfig.from_dict(copy.deepcopy(PUBLISHED[name]))
    assert ModelConfig.from_hf_config(theirs, name=name) == preset  # as transformers 5 resolves the file


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_counts_are_transformers_own_models(name):
    cfg, hf = PRESETS[name], meta_model(name)
    s = accounting.param_summary(cfg)["value"]
    assert s["total"] == TOTALS[name] == numel(hf) == accounting.param_table(cfg).params.sum()
    with torch.device("meta"):
        assert numel(HookedTransformer(cfg)) == TOTALS[name]  # and what lenskit builds
    per_layer = hf.model.embed_tokens_per_layer.weight.numel() if cfg.block.d_per_layer else 0
    assert s.get("per_layer_embed", 0) == per_layer
    assert s["non_embedding"] == TOTALS[name] - hf.model.embed_tokens.weight.numel() - per_layer  # tied: no head
    for layer, block in zip(range(cfg.n_layers), hf.model.layers):  # each block as transformers holds it
        assert accounting.block_params(cfg, layer).params.sum() == numel(block)


def test_the_mixture_counts_what_a_token_uses():
    """26B-A4B: active parameters leave out the 120 experts a token skips in each block (Google's "3.8B active")."""
    cfg, hf = PRESETS["gemma-4-26b-a4b"], meta_model("gemma-4-26b-a4b")
    s = accounting.param_summary(cfg)["value"]
    experts = hf.model.layers[0].experts
    per_expert = (experts.gate_up_proj.numel() + experts.down_proj.numel()) // cfg.moe.n_experts
    assert s["per_expert"] == per_expert and s["experts"] == cfg.n_layers * cfg.moe.n_experts * per_expert
    assert s["active"] == TOTALS["gemma-4-26b-a4b"] - cfg.n_layers * (cfg.moe.n_experts - 8) * per_expert
    assert 3.75e9 < s["active"] < 3.85e9
    flops = accounting.flops_per_token(cfg, n_ctx=1024)["forward"]
    d, block = cfg.d_model, accounting.block_params(cfg)
    assert flops["mlp"] == 2 * cfg.n_layers * (3 * d * 2112 + d * 128 + 8 * 3 * d * 704)  # dense, router, 8 experts
    assert block.loc["mlp", "params"] == 3 * d * 2112 + d * 128 + d + 128 + 128 * 3 * d * 704


def shrunk(name: str) -> ModelConfig:
    """The preset at test size: the same pieces and layer pattern, small widths and vocabularies."""
    small = dict(d_model=128, n_heads=8, d_head=16, full_d_head=32, d_mlp=96, d_vocab=101, n_ctx=32)
    changes = {"gemma-4-e2b": dict(n_layers=10, n_kv_heads=1, d_per_layer=8, d_vocab_per_layer=101),
               "gemma-4-e4b": dict(n_layers=12, n_kv_heads=2, d_per_layer=8, d_vocab_per_layer=101),
               "gemma-4-26b-a4b": dict(n_layers=6, n_kv_heads=4, full_n_kv_heads=1, n_experts=8, d_expert=16)}[name]
    return PRESETS[name].replace(**small, **changes)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_flops_are_torchs_on_a_shrunk_copy(name):
    cfg = shrunk(name)
    assert cfg.block.n_kv_shared_layers == {"gemma-4-e2b": 5, "gemma-4-e4b": 5, "gemma-4-26b-a4b": 0}[name]
    model = HookedTransformer(cfg).eval()
    assert numel(model) == accounting.param_summary(cfg).loc["total", "value"]
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    eager = [(f"blocks.{i}.attn.hook_pattern", unchanged_copy) for i in range(cfg.n_layers)]
    with FlopCounterMode(display=False) as counter, model.hooks(eager), torch.no_grad():
        model(tokens)
    assert counter.get_total_flops() / tokens.numel() == accounting.flops_per_token(cfg, n_ctx=16)["forward"]["total"]


def run_info(name: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info", "--model", name]) == 0
    return out.getvalue()


def test_info_shows_the_sizes():
    e2b = run_info("gemma-4-e2b")
    s = accounting.param_summary("gemma-4-e2b")["value"]
    assert f"{TOTALS['gemma-4-e2b']:,}" in e2b and f"{s['per_layer_embed']:,}" in e2b and "per_layer_embed" in e2b
    assert "per_layer_inputs=256" in e2b and "kv_shared_blocks=20 (blocks 15..34 read the keys of blocks [13, 14])" in e2b
    moe = run_info("gemma-4-26b-a4b")
    s = accounting.param_summary("gemma-4-26b-a4b")["value"]
    assert f"{TOTALS['gemma-4-26b-a4b']:,}" in moe and f"{s['active']:,}" in moe
    assert "experts=128 top_k=8 d_expert=704 routing=softmax_topk_renorm experts_beside_mlp" in moe

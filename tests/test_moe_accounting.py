"""Parameter and FLOP accounting of mixtures of experts (lenskit.accounting): totals equal transformers' own models
built on the meta device, active parameters leave out exactly the experts a token skips, FLOPs equal torch's
counter on a real forward, and `lenskit info` reports both."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import transformers
from fixtures import unchanged_copy
from torch.utils.flop_counter import FlopCounterMode

import lenskit
from lenses.cli import main as cli_main
from lenskit import PRESETS, ModelConfig, accounting
from lenskit.families import family_of

MOE_PRESETS = ["mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "olmoe-1b-7b", "gpt-oss-20b", "gpt-oss-120b"]


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied matrix once


def meta_model(cfg: ModelConfig) -> torch.nn.Module:
    family = family_of(cfg.family)
    config = getattr(transformers, family.hf_config_class).from_dict(cfg.to_hf_dict())
    with torch.device("meta"):
        return getattr(transformers, family.hf_class)(config)


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_totals_and_active_params_equal_transformers_meta_model(name):
    cfg = PRESETS[name]
    hf = meta_model(cfg)
    s = accounting.param_summary(cfg)["value"]
    assert s["total"] == numel(hf) == accounting.param_table(cfg).params.sum()
    # What a token skips, counted from transformers' own expert tensors [expert, ...].
    skipped = 0
    for layer in hf.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            n = experts.gate_up_proj.shape[0]
            own = [p for name, p in experts.named_parameters()]  # the fused weights, and gpt-oss's fused biases
            assert len(own) == (4 if cfg.family == "gpt_oss" else 2)
            per_expert = sum(p.numel() for p in own) // n
            skipped += (n - hf.config.num_experts_per_tok) * per_expert
    assert skipped > 0 and s["active"] == numel(hf) - skipped
    assert s["experts"] == sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)


def test_gpt_oss_counts_its_sinks_and_biases_and_matches_the_published_sizes():
    """Sinks (a logit per head) and the q/k/v/o, router and expert biases are counted, as transformers' own tiny
    model holds them; the presets are OpenAI's 21B (3.6B active) and 117B (5.1B active), active counted without
    the embedding as OpenAI counts it."""
    cfg = PRESETS["gpt-oss-20b"].replace(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_head=16, d_mlp=32,
                                         d_expert=32, n_experts=4, n_experts_per_token=2, d_vocab=101, n_ctx=64,
                                         sliding_window=8, layer_types=("sliding", "full"))
    hf, ours = meta_model(cfg), lenskit.HookedTransformer(cfg)
    s = accounting.param_summary(cfg)["value"]
    assert s["total"] == numel(hf) == numel(ours)
    biases = sum(p.numel() for n, p in hf.named_parameters() if n.endswith(("bias", "sinks")))
    assert s["biases"] == biases and biases > 2 * cfg.n_heads
    assert accounting.block_params(cfg).loc["attn", "biases"] == sum(
        p.numel() for n, p in hf.model.layers[0].self_attn.named_parameters() if n.endswith(("bias", "sinks")))
    for name, total, active in (("gpt-oss-20b", 20.9e9, 3.6e9), ("gpt-oss-120b", 116.8e9, 5.1e9)):
        s = accounting.param_summary(name)["value"]
        assert abs(s["total"] - total) < 0.05e9 and abs(s["active"] - s["embed"] - active) < 0.05e9, name


def test_a_sparse_model_with_dense_blocks_counts_each_kind():
    cfg = PRESETS["qwen3-30b-a3b"].replace(n_layers=5, d_model=64, n_heads=4, n_kv_heads=2, d_head=16, d_mlp=96,
                                           d_expert=24, n_experts=8, n_experts_per_token=2, d_vocab=101, n_ctx=32,
                                           dense_layers=(1, 3))
    hf, ours = meta_model(cfg), lenskit.HookedTransformer(cfg)
    s = accounting.param_summary(cfg)["value"]
    assert s["total"] == numel(hf) == numel(ours) == accounting.param_table(cfg).params.sum()
    for i, block in enumerate(ours.blocks):
        assert accounting.block_params(cfg, i).loc["mlp", "params"] == numel(block.mlp)
    assert s["active"] == numel(ours) - 3 * (8 - 2) * 3 * 64 * 24  # three MoE blocks, six experts skipped in each


def counted_flops_per_token(cfg) -> float:
    """torch's FlopCounterMode on a real forward of a random `cfg` model, per token, every block on the eager
    attention path (a pattern hook) so that the attention core's matmuls are counted as the accounting counts them."""
    model = lenskit.HookedTransformer(cfg).eval()
    tokens = torch.randint(0, cfg.d_vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    eager = [(f"blocks.{i}.attn.hook_pattern", unchanged_copy) for i in range(cfg.n_layers)]
    with FlopCounterMode(display=False) as counter, model.hooks(eager), torch.no_grad():
        model(tokens)
    return counter.get_total_flops() / tokens.numel()


def test_flops_count_only_the_routed_experts_as_torchs_counter_sees_them():
    cfg = ModelConfig(n_layers=3, d_model=32, n_heads=4, d_vocab=101, n_ctx=16, norm="rmsnorm", mlp="swiglu",
                      positional="rotary", fused_qkv=False, qkv_bias=False, out_bias=False, n_experts=4,
                      n_experts_per_token=2, d_expert=24, dense_layers=(1,))
    flops = accounting.flops_per_token(cfg)["forward"]
    assert counted_flops_per_token(cfg) == flops["total"]
    dense_mlp = 3 * 32 * cfg.d_mlp
    assert flops["mlp"] == 2 * (dense_mlp + 2 * (32 * 4 + 2 * 3 * 32 * 24))  # router + k experts, twice; one dense


def test_gpt_oss_flops_count_the_router_and_the_routed_experts():
    cfg = PRESETS["gpt-oss-20b"].replace(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_head=16, d_mlp=24,
                                         d_expert=24, n_experts=4, n_experts_per_token=2, d_vocab=101, n_ctx=16,
                                         sliding_window=32, layer_types=("sliding", "full"))
    flops = accounting.flops_per_token(cfg)["forward"]
    assert counted_flops_per_token(cfg) == flops["total"]
    assert flops["mlp"] == 2 * 2 * (32 * 4 + 2 * 3 * 32 * 24)  # per block: the router and 2 of 4 experts, twice


def test_info_reports_total_and_active_params():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["info", "--model", "mixtral-8x7b"]) == 0
    text = out.getvalue()
    s = accounting.param_summary("mixtral-8x7b")["value"]
    assert "experts=8 top_k=2 d_expert=14336 routing=softmax_topk_renorm" in text
    assert f"{s['total']:,}" in text and f"{s['active']:,}" in text and "active" in text
    assert 12.8e9 < s["active"] < 13.0e9 and 46.6e9 < s["total"] < 46.8e9  # Mistral AI's 12.9B of 46.7B

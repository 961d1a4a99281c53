"""Accounting: counts against real modules and hand arithmetic, FLOPs against torch's FLOP counter."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import lenskit
from lenskit import accounting
from lenskit.config import ModelConfig


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # .parameters() yields a tied weight once


def meta_model(cfg: ModelConfig) -> lenskit.HookedTransformer:
    with torch.device("meta"):  # shapes only: gpt2-xl without 6 GB of memory
        return lenskit.HookedTransformer(cfg)


# hand arithmetic: per block 12 d^2 + 13 d; embeddings V d + n_ctx d; final norm 2 d; tied unembedding
def gpt2_hand(L: int, d: int, V: int = 50257, n_ctx: int = 1024) -> dict[str, int]:
    per_block = 12 * d * d + 13 * d
    return {"per_block": per_block, "non_embedding": L * per_block + 2 * d,
            "total": V * d + n_ctx * d + L * per_block + 2 * d}


@pytest.mark.parametrize("name, L, d", [("gpt2", 12, 768), ("gpt2-xl", 48, 1600)])
def test_gpt2_presets_match_hand_arithmetic_and_real_modules(name, L, d):
    s = accounting.param_summary(name)["value"]
    hand = gpt2_hand(L, d)
    for key, value in hand.items():
        assert s[key] == value, key
    assert s["total"] == numel(meta_model(ModelConfig.from_name(name)))
    block = accounting.block_params(name)
    assert block.loc["attn", "weights"] == 4 * d * d and block.loc["mlp", "weights"] == 8 * d * d
    assert block.loc["attn", "biases"] == 4 * d and block.loc["mlp", "biases"] == 5 * d
    assert block.loc["norms", "params"] == 4 * d
    assert s["unembed"] == 0  # tied: counted once, in the embedding


def test_gpt2_small_reproduces_the_chapters_figures():
    s = accounting.param_summary("gpt2")["value"]
    assert s["total"] == 124_439_808  # the published size of GPT-2 small
    assert 84e6 < s["non_embedding"] < 86e6  # "about 85M"
    assert s["per_block_over_d2"] == pytest.approx(12 + 13 / 768)
    assert s["mlp_share_of_block"] == pytest.approx(2 / 3, abs=1e-3)

    row = accounting.accounting_row("gpt2", n_ctx=1024)
    assert row["dense_flops_over_params"] == pytest.approx(2.0, abs=0.02)  # FLOPs ~ 2 x params per token
    # attention core: 2 matmuls x 2 FLOPs x n_layers x n_ctx x d = 37,748,736 per token forward
    assert row["attn_core_flops_per_token"] == 4 * 12 * 1024 * 768
    assert row["attn_core_over_2n_nonembed"] == pytest.approx(4 * 12 * 1024 * 768 / (2 * 85_056_000))  # ~22%
    assert 0.20 < row["attn_core_over_2n_nonembed"] < 0.23 and 0.14 < row["attn_core_over_2n_total"] < 0.16


def test_gpt2_flops_by_hand():
    f = accounting.flops_per_token("gpt2", n_ctx=1024)
    d, L, V = 768, 12, 50257
    assert f.loc["attn_proj", "forward"] == 2 * L * 4 * d * d
    assert f.loc["mlp", "forward"] == 2 * L * 8 * d * d
    assert f.loc["unembed", "forward"] == 2 * d * V
    assert f.loc["total", "forward"] == 2 * L * 12 * d * d + 4 * L * 1024 * d + 2 * d * V
    assert (f["training"] == 3 * f["forward"]).all()
    assert f.loc[f.index != "total", "share"].sum() == pytest.approx(1.0)
    causal = accounting.flops_per_token("gpt2", n_ctx=1024, causal=True)
    assert causal.loc["attn_core", "forward"] == pytest.approx(4 * L * 512.5 * d)
    assert accounting.six_nd("gpt2", 1e9) == 6 * 85_056_000 * 1e9
    assert accounting.six_nd("gpt2", 1e9, non_embedding=False) == 6 * 124_439_808 * 1e9


@pytest.mark.parametrize("changes", [
    {},
    {"norm": "rmsnorm"},
    {"mlp": "swiglu", "d_mlp": 88},
    {"tie_word_embeddings": False},
    {"d_head": 5, "d_mlp": 50},  # d_attn = 20 != d_model
])
def test_counts_equal_a_real_models_parameters(changes):
    cfg = ModelConfig(n_layers=3, d_model=32, n_heads=4, d_vocab=101, n_ctx=64).replace(**changes)
    model = lenskit.HookedTransformer(cfg)
    table = accounting.param_table(model)
    assert table.params.sum() == numel(model)
    assert accounting.param_summary(cfg).loc["total", "value"] == numel(model)
    per_block = accounting.block_params(cfg)
    for component, module_name in [("attn", "attn"), ("mlp", "mlp")]:
        assert per_block.loc[component, "params"] == numel(getattr(model.blocks[0], module_name))
    assert per_block.loc["norms", "params"] == numel(model.blocks[0].ln1) + numel(model.blocks[0].ln2)
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith("bias"))
    assert table.biases.sum() == biases
    non_emb = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("blocks.", "ln_final.")))
    assert accounting.param_summary(cfg).loc["non_embedding", "value"] == non_emb


def test_flops_equal_torchs_flop_counter_on_a_real_forward():
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=101, n_ctx=16)
    model = lenskit.HookedTransformer(cfg).eval()
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    # a no-op hook on the pattern selects the eager attention path, whose matmuls the counter sees
    eager = [(f"blocks.{i}.attn.hook_pattern", lambda x, hook: None) for i in range(cfg.n_layers)]
    with FlopCounterMode(display=False) as counter, model.hooks(eager):
        model(tokens)
    assert counter.get_total_flops() / tokens.numel() == accounting.flops_per_token(cfg)["forward"]["total"]


def test_accepts_models_configs_and_names_and_rejects_others():
    rows = accounting.compare({"small": "gpt2", "xl": ModelConfig.from_name("gpt2-xl")}, n_ctx=1024)
    assert list(rows.model) == ["small", "xl"] and rows.params.is_monotonic_increasing
    with pytest.raises(KeyError, match="no preset"):
        accounting.param_summary("gpt5")
    with pytest.raises(TypeError, match="expected a ModelConfig"):
        accounting.param_table(42)
    with pytest.raises(ValueError, match="n_ctx"):
        accounting.flops_per_token("gpt2", n_ctx=0)

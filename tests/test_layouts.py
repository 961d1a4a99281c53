"""Checkpoint layouts: templated block names (per-expert tensors, as MoE families store them), reshapes and
their inverses, and the loader's check of every key through a layout that uses them.

No MoE family is registered yet, so a fake one is, for the length of a test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lenskit import CheckpointError, ModelConfig
from lenskit.families import FAMILIES
from lenskit.families.gpt2 import LAYOUT as GPT2
from lenskit.families.gpt_neox import NEOX_QKV
from lenskit.families.layouts import TRANSPOSE, Layout, Reshape
from lenskit.io.loading import convert_hf_state_dict, to_hf_state_dict

MOE = Layout(
    prefix="model.", blocks="layers",
    top={"embed.weight": "embed_tokens.weight", "unembed.weight": "lm_head.weight"},
    block={
        "mlp.router.weight": "mlp.gate.weight",
        "mlp.experts.{e}.gate.weight": "mlp.experts.{e}.gate_proj.weight",  # one tensor per expert
        "mlp.experts.{e}.fc_out.weight": "mlp.experts.{e}.down_proj.weight",
        "mlp.experts.gate_up": "mlp.experts.gate_up_proj",  # all experts fused in one tensor
    },
    reshape={"mlp.experts.{e}.fc_out.weight": TRANSPOSE},
)
N_EXPERTS = 12  # two-digit indices too
SHAPES = {
    "embed.weight": (7, 4), "unembed.weight": (7, 4),
    **{f"blocks.{i}.{k}": s for i in range(2) for k, s in (
        ("mlp.router.weight", (N_EXPERTS, 4)), ("mlp.experts.gate_up", (N_EXPERTS, 4, 12)),
        *((f"mlp.experts.{e}.gate.weight", (6, 4)) for e in range(N_EXPERTS)),
        *((f"mlp.experts.{e}.fc_out.weight", (4, 6)) for e in range(N_EXPERTS)))},
}
CFG = ModelConfig(n_layers=2, d_model=4, n_heads=1, d_vocab=7, n_ctx=8, family="fake_moe", tie_word_embeddings=False)


@pytest.fixture
def fake_moe(monkeypatch):
    """A registered family "fake_moe" whose checkpoints use the MOE layout."""
    monkeypatch.setitem(FAMILIES, "fake_moe", dataclasses.replace(FAMILIES["llama"], model_type="fake_moe", layout=MOE))


def test_templated_names_expand_against_our_own_keys():
    names = MOE.name_map(SHAPES, CFG.n_layers)
    assert len(names) == len(SHAPES)  # one checkpoint name per parameter, none invented
    assert names["layers.1.mlp.experts.11.gate_proj.weight"] == "blocks.1.mlp.experts.11.gate.weight"
    assert names["layers.0.mlp.experts.3.down_proj.weight"] == "blocks.0.mlp.experts.3.fc_out.weight"
    assert names["layers.0.mlp.experts.gate_up_proj"] == "blocks.0.mlp.experts.gate_up"
    assert names["lm_head.weight"] == "unembed.weight"
    with pytest.raises(KeyError, match="mlp.experts.x.gate.weight"):  # a placeholder is a decimal index
        MOE.name_map(["blocks.0.mlp.experts.x.gate.weight"], 1)


def test_reshapes_apply_to_templated_names_and_invert():
    ours = "blocks.1.mlp.experts.10.fc_out.weight"
    assert MOE.reshape_of(ours) is TRANSPOSE and MOE.reshape_of("blocks.1.mlp.experts.10.gate.weight") is None
    assert MOE.stored_shape(ours, (4, 6)) == (6, 4)
    t = torch.randn(4, 6)
    assert torch.equal(MOE.to_ours(ours, MOE.to_stored(ours, t, CFG), CFG), t)


def test_neox_qkv_interleave_inverts():
    cfg = ModelConfig(n_layers=1, d_model=12, n_heads=3, d_vocab=5, n_ctx=4, family="gpt_neox")
    weight, bias = torch.randn(36, 12), torch.randn(36)
    for t in (weight, bias):
        assert torch.equal(NEOX_QKV.save(NEOX_QKV.load(t, cfg), cfg), t)
        assert not torch.equal(NEOX_QKV.load(t, cfg), t)  # a real permutation, not the identity
    assert GPT2.stored_shape("blocks.0.attn.qkv.weight", (96, 32)) == (32, 96)


def test_a_layout_with_templates_loads_strictly(fake_moe):
    state = {k: torch.randn(s) for k, s in SHAPES.items()}
    raw = to_hf_state_dict(state, CFG)
    assert raw["model.layers.0.mlp.experts.5.down_proj.weight"].shape == (6, 4)
    back = convert_hf_state_dict(raw, CFG, SHAPES)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)

    extra = {**raw, "model.layers.0.mlp.experts.12.gate_proj.weight": torch.randn(6, 4)}  # a 13th expert
    with pytest.raises(CheckpointError, match=r"does not: \['layers\.0\.mlp\.experts\.12\.gate_proj\.weight'\]"):
        convert_hf_state_dict(extra, CFG, SHAPES)
    missing = {k: v for k, v in raw.items() if k != "model.layers.1.mlp.experts.7.gate_proj.weight"}
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['layers\.1\.mlp\.experts\.7\.gate_proj\.weight'\]"):
        convert_hf_state_dict(missing, CFG, SHAPES)
    wrong = {**raw, "model.layers.0.mlp.experts.2.down_proj.weight": torch.randn(4, 6)}  # not transposed
    with pytest.raises(CheckpointError, match=r"experts\.2\.down_proj\.weight.*\(4, 6\).*\(6, 4\)"):
        convert_hf_state_dict(wrong, CFG, SHAPES)


def test_a_reshape_without_an_inverse_refuses_to_save(fake_moe, monkeypatch):
    one_way = Reshape(lambda t, cfg: t.flip(0), None)
    layout = dataclasses.replace(MOE, reshape={"mlp.experts.{e}.gate.weight": one_way})
    monkeypatch.setitem(FAMILIES, "fake_moe", dataclasses.replace(FAMILIES["fake_moe"], layout=layout))
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.experts\.0\.gate\.weight.*no inverse.*not implemented"):
        to_hf_state_dict({k: torch.zeros(s) for k, s in SHAPES.items()}, CFG)


def test_inconsistent_layouts_are_refused_when_written():
    with pytest.raises(ValueError, match=r"placeholders \['e'\] are missing on our side"):
        Layout(prefix="", blocks="h", top={}, block={"mlp.gate.weight": "mlp.experts.{e}.gate_proj.weight"})
    with pytest.raises(ValueError, match=r"reshapes \['mlp.up.weight'\]"):
        Layout(prefix="", blocks="h", top={}, block={"mlp.fc_in.weight": "mlp.c_fc.weight"},
               reshape={"mlp.up.weight": TRANSPOSE})

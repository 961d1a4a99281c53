"""`model.OV`, `model.QK` (and per block `blocks[l].attn.OV` / `.QK`) and `tl_parameters()` against TransformerLens 4.3's
bridge on the same checkpoint: the tiny GPT-2 with TransformerLens's processing, and a grouped-query Llama."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_family
from references import transformer_lens_4_3
from tiny_tokenizer import VOCAB, make_tokenizer
from tl_fixtures import boot_bridge, tiny_gpt2_folder

import lenskit
from lenskit.factored import FactoredMatrix

PROCESSED = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)


def same_circuit(ours: FactoredMatrix, theirs) -> None:
    assert isinstance(ours, FactoredMatrix) and ours.shape == theirs.shape
    assert (ours.AB - theirs.AB).abs().max().item() < 1e-5
    assert (ours.S - theirs.S).abs().max().item() < 1e-5


@pytest.mark.slow  # boots the bridge
def test_ov_qk_match_the_bridge_on_processed_gpt2():
    folder = tiny_gpt2_folder()
    ours = lenskit.HookedTransformer.from_pretrained(folder, **PROCESSED)
    bridge = boot_bridge(folder)
    assert ours.OV.shape == (2, 4, 64, 64)
    same_circuit(ours.OV, bridge.OV)
    same_circuit(ours.QK, bridge.QK)
    for layer in range(2):
        same_circuit(ours.blocks[layer].attn.OV, bridge.OV[layer])
        same_circuit(ours.blocks[layer].attn.QK, bridge.QK[layer])
    raw = lenskit.HookedTransformer.from_pretrained(folder)
    assert (raw.OV.AB - ours.OV.AB).abs().max().item() > 1e-3  # processing changed OV, so the comparison can fail


def test_ov_qk_are_the_head_products():
    model = lenskit.HookedTransformer.from_pretrained(tiny_gpt2_folder())
    attn = model.blocks[1].attn
    for h in range(4):
        torch.testing.assert_close(model.OV[1, h].AB, attn.W_V[h] @ attn.W_O[h])
        torch.testing.assert_close(model.QK[1, h].AB, attn.W_Q[h] @ attn.W_K[h].T)


@pytest.mark.slow  # boots the bridge
def test_ov_qk_repeat_kv_heads_under_gqa_as_the_bridge_does(tmp_path, monkeypatch):
    transformer_lens_4_3()
    from transformer_lens.model_bridge import TransformerBridge

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_hf_family("llama", vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    ours = lenskit.HookedTransformer.from_pretrained(tmp_path)
    assert ours.cfg.n_kv_heads == 2 and ours.cfg.n_heads == 4
    bridge = TransformerBridge.boot_transformers(str(tmp_path), device="cpu").eval()
    bridge.enable_compatibility_mode(disable_warnings=True, fold_ln=False, center_writing_weights=False,
                                     center_unembed=False, fold_value_biases=False)
    same_circuit(ours.OV, bridge.OV)
    same_circuit(ours.QK, bridge.QK)
    # heads 0 and 1 read kv head 0, so their OV circuits share W_V
    attn = ours.blocks[0].attn
    torch.testing.assert_close(attn.OV.A[0], attn.OV.A[1])
    assert not torch.equal(attn.OV.A[1], attn.OV.A[2])


@pytest.mark.slow  # boots the bridge
def test_tl_parameters_match_the_bridge():
    folder = tiny_gpt2_folder()
    ours = lenskit.HookedTransformer.from_pretrained(folder)
    bridge = boot_bridge(folder, fold_ln=False, center_writing_weights=False, center_unembed=False,
                         fold_value_biases=False)
    mine, theirs = ours.tl_parameters(), bridge.tl_parameters()
    assert [n for n, _ in ours.tl_named_parameters()] == list(mine)
    wanted = {"embed.W_E", "pos_embed.W_pos", "unembed.W_U", "unembed.b_U", "ln_final.w", "ln_final.b"}
    wanted |= {f"blocks.{l}.{n}" for l in range(2) for n in (
        "attn.W_Q", "attn.W_K", "attn.W_V", "attn.W_O", "attn.b_Q", "attn.b_K", "attn.b_V", "attn.b_O",
        "mlp.W_in", "mlp.W_out", "mlp.b_in", "mlp.b_out", "ln1.w", "ln1.b", "ln2.w", "ln2.b")}
    assert wanted <= set(mine) and wanted <= set(theirs), (wanted - set(mine), wanted - set(theirs))
    for name in sorted(wanted):
        assert mine[name].shape == theirs[name].shape, name
        assert (mine[name] - theirs[name]).abs().max().item() < 1e-6, name

"""`lenskit.conveniences`: TransformerLens's model conveniences, each held beside TransformerLens 4.3's bridge in
compatibility mode on the same tiny GPT-2 (processed weights beside its default processing, raw beside raw)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_family
from tiny_tokenizer import VOCAB
from tl_fixtures import EOS, boot_bridge, tiny_gpt2_folder

import lenskit

pytestmark = pytest.mark.slow  # booting the bridge takes seconds

PROCESSED = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)
RAW = {k: False for k in PROCESSED}
TEXT = "The cat sat on the mat. The mat sat on the cat."


@pytest.fixture(scope="module")
def pair():
    folder = tiny_gpt2_folder()
    return lenskit.HookedTransformer.from_pretrained(folder, **PROCESSED).eval(), boot_bridge(folder)


@pytest.fixture(scope="module")
def raw_pair():
    folder = tiny_gpt2_folder()
    return lenskit.HookedTransformer.from_pretrained(folder).eval(), boot_bridge(folder, **RAW)


def test_get_token_position_finds_what_the_bridge_finds(pair):
    ours, theirs = pair
    tokens = theirs.to_tokens(TEXT)  # [1, pos], BOS first
    cat = theirs.to_single_token(" cat")
    for mode in ("first", "last"):
        for bos in (True, False):
            assert ours.get_token_position(" cat", TEXT, mode, prepend_bos=bos) == \
                theirs.get_token_position(" cat", TEXT, mode, prepend_bos=bos)
        for single in (" cat", cat, torch.tensor(cat)):
            for where in (tokens, tokens[0]):
                assert ours.get_token_position(single, where, mode) == theirs.get_token_position(single, where, mode)
    assert ours.get_token_position(" cat", TEXT, "first", prepend_bos=True) == 2  # hand count: BOS, The, cat
    assert ours.get_token_position(" cat", TEXT, "first", prepend_bos=False) == 1


def test_get_token_position_refuses_clearly(pair):
    ours, _ = pair
    with pytest.raises(ValueError, match="does not occur"):
        ours.get_token_position(" dog", TEXT, prepend_bos=False)
    with pytest.raises(ValueError, match="mode must be"):
        ours.get_token_position(" cat", TEXT, mode="middle")
    with pytest.raises(ValueError, match=r"\[1, pos\]"):
        ours.get_token_position(" cat", ours.to_tokens([TEXT, TEXT], prepend_bos=False))
    with pytest.raises(ValueError, match="tokens"):
        ours.get_token_position(" cats on", TEXT)


def test_tokens_to_residual_directions_are_the_bridges(pair, raw_pair):
    for ours, theirs in (pair, raw_pair):
        ids = theirs.to_tokens(["When Mary and John", "After John and Mary"], prepend_bos=False)  # [2, 4]
        for tokens in (" Mary", theirs.to_single_token(" John"), torch.tensor(9), torch.tensor([9]), ids[0], ids,
                       ids[:, :2]):
            got, want = ours.tokens_to_residual_directions(tokens), theirs.tokens_to_residual_directions(tokens)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    ours, _ = raw_pair
    assert ours.tokens_to_residual_directions(7).shape == (ours.cfg.d_model,)
    torch.testing.assert_close(ours.tokens_to_residual_directions(ids)[1, 2], ours.unembed.weight[ids[1, 2]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.tokens_to_residual_directions(ours.cfg.d_vocab)


def test_loss_fn_and_forward_loss_per_token_match_the_bridge(pair):
    ours, theirs = pair
    tokens = theirs.to_tokens(["The cat sat on the mat", "A dog ran"])  # right-padded with EOS
    mask = (torch.arange(tokens.shape[1]) < torch.tensor([[7], [4]])).long()  # [batch, pos]: BOS + real tokens
    logits = ours(tokens)
    for attention_mask in (None, mask):
        for per_token in (False, True):
            got = ours.loss_fn(logits, tokens, attention_mask, per_token)
            want = theirs.loss_fn(logits, tokens, attention_mask, per_token)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    per_token = ours(tokens, return_type="loss", loss_per_token=True)
    assert per_token.shape == (2, tokens.shape[1] - 1)
    torch.testing.assert_close(per_token, theirs(tokens, return_type="loss", loss_per_token=True), atol=1e-4, rtol=1e-4)
    logits_too, loss = ours(tokens, return_type="both", loss_per_token=True)
    torch.testing.assert_close(loss, per_token)
    torch.testing.assert_close(ours(tokens, return_type="loss"), per_token.mean())
    # by hand: a masked mean counts only predictions whose position and next position are both real
    kept = (mask[:, :-1] * mask[:, 1:]).bool()
    torch.testing.assert_close(ours.loss_fn(logits, tokens, mask), per_token[kept].mean(), atol=1e-5, rtol=1e-5)


def test_accumulated_bias_matches_the_bridge(pair, raw_pair):
    for ours, theirs in (pair, raw_pair):
        n = ours.cfg.n_layers
        for layer in range(n + 1):
            for include_mlp_biases in (True, False):
                for mlp_input in (False, True) if layer < n else (False,):
                    got = ours.accumulated_bias(layer, mlp_input, include_mlp_biases)
                    want = theirs.accumulated_bias(layer, mlp_input, include_mlp_biases)
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    ours, _ = raw_pair
    b = ours.blocks
    torch.testing.assert_close(ours.accumulated_bias(1, mlp_input=True),
                               b[0].attn.out.bias + b[0].mlp.fc_out.bias + b[1].attn.out.bias)
    with pytest.raises(ValueError, match="layer must be"):
        ours.accumulated_bias(n + 1)
    with pytest.raises(ValueError, match="mlp_input"):
        ours.accumulated_bias(n, mlp_input=True)


def test_labels_single_str_tokens_and_input_basis_match_the_bridge(pair, raw_pair):
    for ours, theirs in (pair, raw_pair):
        assert ours.all_head_labels() == theirs.all_head_labels
        for token in (EOS, 464, 3797):
            assert ours.to_single_str_token(token) == theirs.to_single_str_token(token)
        assert ours.W_E_pos.shape == (ours.cfg.d_vocab + ours.cfg.n_ctx, ours.cfg.d_model)
        torch.testing.assert_close(ours.W_E_pos, theirs.W_E_pos, atol=1e-5, rtol=1e-5)
    ours, _ = raw_pair
    assert ours.all_head_labels()[:2] == ["L0H0", "L0H1"] and len(ours.all_head_labels()) == 2 * 4
    with pytest.raises(TypeError, match="int token id"):
        ours.to_single_str_token(torch.tensor(5))


def test_rotary_and_post_norm_families(tmp_path):
    make_hf_family("gemma2", vocab_size=VOCAB).save_pretrained(tmp_path)
    gemma = lenskit.HookedTransformer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="learned positions"):
        gemma.W_E_pos
    # Gemma's sublayers have no biases: nothing constant reaches the stream
    assert torch.equal(gemma.accumulated_bias(gemma.cfg.n_layers), torch.zeros(gemma.cfg.d_model))


def test_accumulated_bias_refuses_expert_biases(tmp_path):
    make_hf_family("gpt_oss", vocab_size=VOCAB).save_pretrained(tmp_path)
    model = lenskit.HookedTransformer.from_pretrained(tmp_path)  # biased attention, biased experts
    with pytest.raises(ValueError, match="router's expert weights"):
        model.accumulated_bias(1)
    attn_only = model.accumulated_bias(2, include_mlp_biases=False)
    torch.testing.assert_close(attn_only, model.blocks[0].attn.out.bias + model.blocks[1].attn.out.bias)


def test_transformer_lens_defaults_reach_the_conveniences(pair):
    import lenskit.transformer_lens as transformer_lens

    _, theirs = pair
    ours = transformer_lens.HookedTransformer.from_pretrained(str(tiny_gpt2_folder()))  # BOS first by default
    for mode in ("first", "last"):
        assert ours.get_token_position(" cat", TEXT, mode) == theirs.get_token_position(" cat", TEXT, mode)
    tokens = ours.to_tokens(TEXT)
    torch.testing.assert_close(ours(tokens, return_type="loss", loss_per_token=True),
                               theirs(tokens, return_type="loss", loss_per_token=True), atol=1e-4, rtol=1e-4)

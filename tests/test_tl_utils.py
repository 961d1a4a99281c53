"""`lenskit.transformer_lens.utils`, each function held beside TransformerLens 4.3's own (`transformer_lens.utilities`)
on the same inputs; `test_prompt` prints what TransformerLens's prints for its bridge on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from references import transformer_lens_4_3
from tl_fixtures import boot_bridge, tiny_gpt2_folder

import lenskit
from lenskit.factored import FactoredMatrix
from lenskit.transformer_lens import utils

PROCESSED = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)


@pytest.fixture(scope="module")
def tl():
    transformer_lens_4_3()
    from transformer_lens import utilities

    return utilities


def test_tensor_helpers_match_transformer_lens(tl):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 5, generator=g, requires_grad=True)
    for value in (x, x.detach().bfloat16(), [1, 2, 3], (1.5, 2.5), 3, 2.0, True, "a", np.arange(4)):
        np.testing.assert_array_equal(utils.to_numpy(value), tl.to_numpy(value))
    assert utils.to_numpy(x.detach().bfloat16()).dtype == np.float32
    for t in (x.detach(), torch.randn(2, 3, generator=g), torch.randn(7, generator=g), torch.tensor(1.0)):
        assert torch.equal(utils.get_corner(t), tl.get_corner(t))
        assert torch.equal(utils.get_corner(t, 2), tl.get_corner(t, 2))
        assert torch.equal(utils.remove_batch_dim(t), tl.remove_batch_dim(t))
    assert utils.remove_batch_dim(x).shape == (4, 5) and utils.remove_batch_dim(torch.zeros(2, 3)).shape == (2, 3)
    assert torch.equal(utils.transpose(x.detach()), tl.transpose(x.detach()))
    square, lower = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g).tril()
    for m in (square, lower, lower[:3], torch.zeros(4), torch.zeros(2, 2, 2), torch.eye(3)):
        assert utils.is_square(m) == tl.is_square(m)
        assert utils.is_lower_triangular(m) == tl.is_lower_triangular(m)
    assert utils.is_lower_triangular(lower) and not utils.is_lower_triangular(square)
    with pytest.raises(TypeError, match="to_numpy takes"):
        utils.to_numpy(object())


def test_get_device_print_gpu_mem_and_names(capsys):
    assert utils.get_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    utils.print_gpu_mem("step")
    assert capsys.readouterr().out == f"step ~ {torch.cuda.memory_allocated() / 2 ** 30:.2f} GiB allocated on GPU.\n"
    assert utils.get_act_name is lenskit.get_act_name and utils.get_act_name("v", 0) == "blocks.0.attn.hook_v"
    from lenskit.observe.slices import Slice

    assert utils.Slice is Slice


def test_activations_match_transformer_lens(tl):
    x = torch.linspace(-6, 6, 1001).reshape(7, 11, 13)
    for ours, theirs in ((utils.gelu_new, tl.gelu_new), (utils.gelu_fast, tl.gelu_fast), (utils.solu, tl.solu)):
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-6)
    # GPT-2's formula, written out by hand
    torch.testing.assert_close(utils.gelu_new(x), 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3))),
                               atol=1e-6, rtol=1e-6)


def test_losses_match_transformer_lens(tl):
    g = torch.Generator().manual_seed(1)
    logits, tokens = torch.randn(3, 6, 11, generator=g), torch.randint(0, 11, (3, 6), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0]])
    for attention_mask in (None, mask, mask.bool()):
        for per_token in (False, True):
            got = utils.lm_cross_entropy_loss(logits, tokens, attention_mask, per_token)
            want = tl.lm_cross_entropy_loss(logits, tokens, attention_mask, per_token)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    logits[0, 2, tokens[0, 3]] = 100.0  # one sure hit
    for per_token in (False, True):
        assert torch.equal(utils.lm_accuracy(logits, tokens, per_token), tl.lm_accuracy(logits, tokens, per_token))
    assert utils.lm_accuracy(logits, tokens, per_token=True)[0, 2]
    # by hand: the loss of position 1 predicting token 2 of row 2
    by_hand = -logits[2, 1].log_softmax(-1)[tokens[2, 2]]
    torch.testing.assert_close(utils.lm_cross_entropy_loss(logits, tokens, per_token=True)[2, 1], by_hand)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        utils.lm_cross_entropy_loss(logits[:, :1], tokens[:, :1])
    with pytest.raises(ValueError, match="attention_mask must have"):
        utils.lm_cross_entropy_loss(logits, tokens, mask[:, :3])


def test_composition_scores_match_transformer_lens(tl):
    from transformer_lens import FactoredMatrix as TheirFactored

    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 3, 8, 4, generator=g), torch.randn(2, 3, 4, 8, generator=g)
    c, d = torch.randn(3, 8, 4, generator=g), torch.randn(3, 4, 8, generator=g)
    ours_l, ours_r = FactoredMatrix(a, b), FactoredMatrix(c, d)
    theirs_l, theirs_r = TheirFactored(a, b), TheirFactored(c, d)
    got = utils.composition_scores(ours_l, ours_r)
    assert got.shape == (2, 3, 3)
    torch.testing.assert_close(got, tl.composition_scores(theirs_l, theirs_r), atol=1e-5, rtol=1e-5)
    got = utils.composition_scores(ours_l, ours_l, broadcast_dims=False)
    torch.testing.assert_close(got, tl.composition_scores(theirs_l, theirs_l, broadcast_dims=False), atol=1e-5, rtol=1e-5)
    # by hand, one pair: ||AB CD||_F / (||AB||_F ||CD||_F)
    left, right = a[1, 2] @ b[1, 2], c[0] @ d[0]
    torch.testing.assert_close(utils.composition_scores(ours_l, ours_r)[1, 2, 0],
                               (left @ right).norm() / left.norm() / right.norm(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="columns to match"):
        utils.composition_scores(FactoredMatrix(a, b), FactoredMatrix(a[..., :5, :], b[..., :5]))


@pytest.mark.slow
def test_test_prompt_prints_what_transformer_lens_prints(tl, capsys):
    folder = tiny_gpt2_folder()
    ours, theirs = lenskit.HookedTransformer.from_pretrained(folder, **PROCESSED).eval(), boot_bridge(folder)
    cases = [("After John and Mary went to the store, John gave a bottle of milk to", " Mary", {}),
             ("The cat sat on the", "mat and the hat", dict(top_k=4)),
             ("The cat sat on the", ["mat", " hat", "dog"], dict(top_k=3)),
             ("The cat sat on the", "mat", dict(prepend_space_to_answer=False, print_details=False))]
    for prompt, answer, options in cases:
        for bos in (True, False):
            utils.test_prompt(prompt, answer, ours, prepend_bos=bos, **options)
            got = capsys.readouterr().out
            tl.test_prompt(prompt, answer, theirs, prepend_bos=bos, **options)
            want = capsys.readouterr().out
            # rich (TransformerLens's printer) wraps lines at 80 columns when stdout is not a terminal
            assert got.split() == want.split(), (prompt, answer, bos)
            assert [l for l in got.splitlines() if l.startswith("Rank:")] == \
                [l for l in want.splitlines() if l.startswith("Rank:")]
    assert "Rank:" in got or "Ranks of the answer tokens" in got
    with pytest.raises(ValueError, match="answer must be"):
        utils.test_prompt("The cat", [], ours)


@pytest.mark.slow
def test_tokenize_and_concatenate_matches_transformer_lens(tl):
    datasets = pytest.importorskip("datasets")
    from transformers import GPT2TokenizerFast

    folder = tiny_gpt2_folder()
    texts = ["The cat sat on the mat.", "", "Hello world, hello again, and hello once more.", "A dog ran off.",
             "Short."]
    data = datasets.Dataset.from_dict({"text": texts, "id": list(range(len(texts)))})
    for max_length in (8, 13, 64):  # 64: the whole stream is shorter than a row, so it is padded to one
        for add_bos_token in (True, False):
            ours = utils.tokenize_and_concatenate(data, GPT2TokenizerFast.from_pretrained(folder), max_length=max_length,
                                                  add_bos_token=add_bos_token, num_proc=None)
            theirs = tl.tokenize_and_concatenate(data, GPT2TokenizerFast.from_pretrained(folder), max_length=max_length,
                                                 add_bos_token=add_bos_token, num_proc=None)
            assert ours.column_names == ["tokens"]
            assert torch.equal(ours[:]["tokens"], theirs[:]["tokens"]), (max_length, add_bos_token)
    # by hand: the documents' tokens joined by EOS, BOS first in each row
    tok = GPT2TokenizerFast.from_pretrained(folder)
    stream = []
    for i, t in enumerate(texts):
        stream += ([tok.eos_token_id] if i else []) + tok.encode(t)
    rows = utils.tokenize_and_concatenate(data, tok, max_length=8, num_proc=None)[:]["tokens"]
    assert rows[:, 0].eq(tok.bos_token_id).all() and rows[:, 1:].flatten().tolist() == stream[: rows.shape[0] * 7]
    assert tok.pad_token is None  # the tokenizer is left as it was
    with pytest.raises(ValueError, match="max_length must be"):
        utils.tokenize_and_concatenate(data, tok, max_length=1)
    with pytest.raises(ValueError, match="no column 'content'"):
        utils.tokenize_and_concatenate(data, tok, column_name="content")

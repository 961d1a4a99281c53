"""`lenskit.transformer_lens.evals`: the offline evals, held beside TransformerLens 4.3's own on its bridge in
compatibility mode on the same tiny GPT-2 (processed weights on both sides)."""

from __future__ import annotations

import pytest
import torch
from tl_fixtures import EOS, boot_bridge, tiny_gpt2_folder

import lenskit
import lenskit.transformer_lens as transformer_lens
from lenskit.transformer_lens import evals, utils

pytestmark = pytest.mark.slow  # booting the bridge takes seconds

PROCESSED = dict(fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)


@pytest.fixture(scope="module")
def pair():
    folder = tiny_gpt2_folder()
    return transformer_lens.HookedTransformer.from_pretrained(str(folder)).eval(), boot_bridge(folder)


def test_induction_loss_matches_transformer_lens(pair):
    from transformer_lens import evals as their_evals

    ours, theirs = pair
    plain = lenskit.HookedTransformer.from_pretrained(tiny_gpt2_folder(), **PROCESSED).eval()
    for model, prepend_bos, their_bos in ((ours, None, None), (ours, False, False), (plain, True, True),
                                          (plain, None, False)):  # lenskit's None: as GPT-2's tokenizer, no BOS
        torch.manual_seed(3)
        got = evals.induction_loss(model, batch_size=3, subseq_len=20, prepend_bos=prepend_bos)
        torch.manual_seed(3)
        want = their_evals.induction_loss(theirs, batch_size=3, subseq_len=20, prepend_bos=their_bos, device="cpu")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_induction_tokens_repeat_and_fit_the_context(pair):
    ours, _ = pair
    tokens = evals.make_induction_tokens(ours, batch_size=2, subseq_len=10, generator=torch.Generator().manual_seed(0))
    assert tokens.shape == (2, 20) and (tokens[:, 0] == EOS).all()  # BOS (GPT-2's is EOS) replaces the first token
    assert torch.equal(tokens[:, 11:], tokens[:, 1:10]) and ((tokens[:, 1:] >= 100) & (tokens[:, 1:] < 20000)).all()
    # the default 384 does not fit n_ctx = 128: each half is cut to 64
    long = evals.make_induction_tokens(ours, generator=torch.Generator().manual_seed(0))
    assert long.shape == (4, ours.cfg.n_ctx)
    seeded = [evals.induction_loss(ours, generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert seeded[0] == seeded[1]
    assert seeded[0] == evals.induction_loss(ours, subseq_len=64, generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="subseq_len must be"):
        evals.make_induction_tokens(ours, subseq_len=0)


def test_evaluate_on_dataset_and_sanity_check_match_transformer_lens(pair):
    datasets = pytest.importorskip("datasets")
    from transformer_lens import evals as their_evals

    ours, theirs = pair
    texts = ["The cat sat on the mat and looked at the door for a while.", "Hello world, hello again.",
             "A dog ran off into the park, and nobody saw it come back."] * 4
    rows = utils.tokenize_and_concatenate(datasets.Dataset.from_dict({"text": texts}), ours.tokenizer, max_length=16,
                                          num_proc=None)
    for truncate in (0, 1, 100):
        loader = torch.utils.data.DataLoader(rows, batch_size=2)
        got = evals.evaluate_on_dataset(ours, loader, truncate=truncate)
        want = their_evals.evaluate_on_dataset(theirs, loader, truncate=truncate, device="cpu")
        assert got == pytest.approx(want, abs=1e-5)
    by_hand = torch.stack([ours(rows[i: i + 2]["tokens"], return_type="loss") for i in (0, 2)]).mean()
    assert evals.evaluate_on_dataset(ours, torch.utils.data.DataLoader(rows, batch_size=2), truncate=1) == \
        pytest.approx(by_hand.item(), abs=1e-6)
    torch.testing.assert_close(evals.sanity_check(ours), theirs(evals.SANITY_TEXT, return_type="loss"), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="'tokens'"):
        evals.evaluate_on_dataset(ours, [{"input_ids": rows[:2]["tokens"]}])

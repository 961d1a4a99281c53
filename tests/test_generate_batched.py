"""Batched generation: texts of different lengths each continue their own text, exactly as each does alone.

The reference for a row is its text decoded alone by hand: greedy argmax of the model's last-position
logits, token by token, the window sliding to the last n_ctx tokens. Rows come back left-padded with the
tokenizer's pad id, so the last max_new_tokens columns are every row's continuation.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_gpt2
from families import family_model_of

from lenskit import HookedTransformer
from lenskit.io.text import pad_token_id

# Learned positions; rotary; parallel blocks with partial rotary; a sliding window (5 tokens in its tiny config).
FAMILIES = ["gpt2", "llama", "gpt_neox", "mistral"]
TEXTS = ["a", "def add(a, b):", "import os\nprint('hello world')\n"]


@torch.no_grad()
def alone(model: HookedTransformer, text: str, n: int) -> torch.Tensor:
    """`text` continued by n greedy tokens, one forward per token on its last n_ctx tokens: [pos + n]."""
    seq = model.to_tokens(text)
    for _ in range(n):
        seq = torch.cat([seq, model(seq[:, -model.cfg.n_ctx:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0]


def assert_rows_are_alone(model: HookedTransformer, out: torch.Tensor, texts: list[str], n: int) -> None:
    want = [alone(model, t, n) for t in texts]
    assert len({len(w) for w in want}) > 1  # the texts do have different lengths
    width = max(len(w) for w in want)
    assert out.shape == (len(texts), width)
    pad = pad_token_id(model.tokenizer)
    for row, w in zip(out, want):
        assert torch.equal(row[width - len(w):], w)
        assert (row[: width - len(w)] == pad).all()
    assert torch.equal(out[:, width - n:], torch.stack([w[len(w) - n:] for w in want]))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_text_continues_as_it_does_alone(family):
    model = family_model_of(family).model
    assert_rows_are_alone(model, model.generate(TEXTS, 6), TEXTS, 6)
    assert_rows_are_alone(model, model.generate(TEXTS[::-1], 6), TEXTS[::-1], 6)  # the longest first, too


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sampling_that_can_only_pick_the_top_token_is_the_greedy_batch(family):
    model = family_model_of(family).model
    greedy = model.generate(TEXTS, 5)
    top1 = model.generate(TEXTS, 5, do_sample=True, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(top1, greedy)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_long_text_slides_its_own_window_beside_a_short_one(family):
    model = family_model_of(family).model
    n_ctx = model.cfg.n_ctx
    long = "x = i\n"
    while model.to_tokens(long + "x = i\n").shape[1] <= n_ctx - 2:
        long += "x = i\n"
    texts = ["a", long]
    out = model.generate(texts, 6)  # the long text passes n_ctx after 2 or 3 tokens; the short one never does
    assert model.to_tokens(long).shape[1] + 6 > n_ctx
    assert_rows_are_alone(model, out, texts, 6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_no_new_tokens_gives_the_texts_left_padded(family):
    model = family_model_of(family).model
    out = model.generate(TEXTS, 0)
    assert_rows_are_alone(model, out, TEXTS, 0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_token_tensor_is_taken_whole_as_before(family):
    model = family_model_of(family).model
    tokens = torch.randint(3, 300, (2, 5), generator=torch.Generator().manual_seed(1))
    want = tokens
    with torch.no_grad():
        for _ in range(4):
            want = torch.cat([want, model(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(model.generate(tokens, 4), want)


def test_texts_need_a_tokenizer_and_only_texts():
    bare = HookedTransformer.from_hf(make_hf_gpt2())
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.generate(["a", "bc"], 2)
    model = family_model_of("gpt2").model
    with pytest.raises(TypeError, match="mixing texts and int"):
        model.generate(["a", 3], 2)

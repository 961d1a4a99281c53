"""generate's TransformerLens arguments: stop_at_eos and eos_token_id (an id or a list; finished rows filled with EOS,
generation ending when every row has), return_type, verbose, freq_penalty, padding_side and prepend_bos, and a
one-line refusal of each bad value. Each holds with the KV cache and without it.

The reference for stopping is the unstopped greedy continuation cut by hand at each row's first stop token.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_gpt2
from families import build_family_model, family_model_of

from lenskit import HookedTransformer

TEXTS = ["a", "def add(a, b):", "import os\nprint('hello world')\n"]


@pytest.fixture(scope="module")
def model() -> HookedTransformer:
    return family_model_of("gpt2").model


def prompt(batch: int = 2, pos: int = 5, seed: int = 2) -> torch.Tensor:
    return torch.randint(1, 300, (batch, pos), generator=torch.Generator().manual_seed(seed))


def cut_at_stops(free: torch.Tensor, stops: list[int], fill: int) -> torch.Tensor:
    """Each row of free new tokens [batch, n] up to its first stop token, then `fill`, to the longest such row."""
    ends = []
    for row in free.tolist():
        hits = [j for j, t in enumerate(row) if t in stops]
        ends.append(hits[0] + 1 if hits else len(row))
    n = max(ends)
    return torch.stack([torch.cat([row[:e], row.new_full((n - e,), fill)]) for row, e in zip(free[:, :n], ends)])


@pytest.mark.parametrize("cached", [True, False])
def test_rows_stop_at_their_eos_and_are_filled_with_it(model, cached):
    tokens = prompt()
    pos = tokens.shape[1]
    free = model.generate(tokens, 10, stop_at_eos=False)[:, pos:]
    eos = model.tokenizer.eos_token_id
    one = int(free[0, 2])  # row 0 stops by its third token; row 1 at its first match, if any
    got = model.generate(tokens, 10, eos_token_id=one, use_past_kv_cache=cached)
    assert torch.equal(got[:, pos:], cut_at_stops(free, [one], one)) and torch.equal(got[:, :pos], tokens)
    both = [int(free[0, 1]), int(free[1, 3])]  # every row stops early: generation ends with the last of them
    got = model.generate(tokens, 10, eos_token_id=both, use_past_kv_cache=cached)
    assert got.shape[1] < pos + 10
    assert torch.equal(got[:, pos:], cut_at_stops(free, both, eos))  # a list fills with the tokenizer's EOS


def test_a_ragged_batch_stops_alike_with_and_without_the_cache(model):
    free = model.generate(TEXTS, 8, stop_at_eos=False)
    stops = [int(free[0, -6]), int(free[2, -3])]
    runs = [model.generate(TEXTS, 8, eos_token_id=stops, use_past_kv_cache=c) for c in (True, False)]
    assert torch.equal(*runs)


def test_stopping_follows_the_tokenizers_eos_by_default():
    bare = HookedTransformer.from_hf(make_hf_gpt2())  # no tokenizer, no EOS: nothing to stop at
    assert bare.generate(prompt() % 101, 6).shape == (2, 11)
    model = build_family_model("llama").model  # fresh: its tokenizer's EOS is changed below
    tokens = prompt(1)
    free = model.generate(tokens, 6, stop_at_eos=False)
    model.tokenizer.eos_token = model.tokenizer.convert_ids_to_tokens(int(free[0, 6]))  # the second new token
    stop = int(free[0, 5:7].tolist().index(int(free[0, 6]))) + 1
    assert torch.equal(model.generate(tokens, 6), free[:, :5 + stop])
    assert torch.equal(model.generate(tokens, 6, stop_at_eos=False), free)


def test_return_types(model):
    text = model.generate("def add(", 4, return_type="str")
    assert isinstance(text, str) and text.startswith("def add(")
    assert model.generate("def add(", 4, return_type="input") == text
    out = model.generate("def add(", 4)
    assert isinstance(out, torch.Tensor) and model.tokenizer.decode(out[0], skip_special_tokens=True) == text
    texts = model.generate(TEXTS, 4, return_type="input")
    assert isinstance(texts, list) and len(texts) == 3 and all(t.startswith(p) for t, p in zip(texts, TEXTS))
    tokens = prompt()
    assert torch.equal(model.generate(tokens, 3, return_type="input"), model.generate(tokens, 3))
    assert isinstance(model.generate(tokens, 3, return_type="str"), list)


def test_verbose_shows_a_bar(model, capsys):
    model.generate(prompt(), 5, stop_at_eos=False, verbose=True)
    assert "generate" in capsys.readouterr().err
    model.generate(prompt(), 5, stop_at_eos=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("cached", [True, False])
def test_a_large_frequency_penalty_never_repeats_a_token(model, cached):
    tokens = torch.arange(10, 16).reshape(1, 6)
    out = model.generate(tokens, 12, do_sample=True, freq_penalty=1e4, generator=torch.Generator().manual_seed(0),
                         stop_at_eos=False, use_past_kv_cache=cached)
    assert len(set(out[0].tolist())) == out.shape[1] == 18
    assert torch.equal(model.generate(tokens, 12, freq_penalty=1e4), model.generate(tokens, 12))  # greedy ignores it


def test_padding_side_right_puts_each_text_first(model):
    left = model.generate(TEXTS, 4, stop_at_eos=False)
    right = model.generate(TEXTS, 4, stop_at_eos=False, padding_side="right")
    pad = left[0, 0]
    for a, b in zip(left, right):
        n = int((a != pad).sum()) if (a == pad).any() else len(a)
        assert torch.equal(b[:n], a[len(a) - n:])


def test_prepend_bos_applies_to_text(model):
    bos = model.tokenizer.bos_token_id
    assert model.generate("def", 2, prepend_bos=True, stop_at_eos=False)[0, 0] == bos
    assert model.generate(["def", "x = 1"], 2, prepend_bos=True, stop_at_eos=False)[:, 0].tolist() == [bos, bos]
    assert model.generate("def", 2, prepend_bos=False, stop_at_eos=False).shape[1] == model.to_tokens("def").shape[1] + 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(return_type="embeds"), "return_type must be one of"),
    (dict(eos_token_id="x"), "eos_token_id must be a token id"),
    (dict(eos_token_id=[]), "eos_token_id must be a token id"),
    (dict(eos_token_id=10 ** 6), "eos_token_id must be a token id"),
    (dict(padding_side="middle"), "padding_side must be"),
    (dict(freq_penalty=-1.0), "freq_penalty must be a finite number >= 0"),
    (dict(stop_at_eos="yes"), "stop_at_eos must be True or False"),
    (dict(use_past_kv_cache=1), "use_past_kv_cache must be True or False"),
    (dict(verbose=None), "verbose must be True or False"),
])
def test_bad_arguments_are_refused_in_one_line(model, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match) as err:
        model.generate(prompt(), 2, **kwargs)
    assert "\n" not in str(err.value)


def test_text_out_needs_a_tokenizer():
    with pytest.raises(ValueError, match="return_type='str' needs a tokenizer"):
        HookedTransformer.from_hf(make_hf_gpt2()).generate(prompt() % 101, 2, return_type="str")

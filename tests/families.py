"""One tiny model per supported family, for running everything above the model on each of them.

`FAMILY_BUILDERS` is the one list the family-parametrised tests read (conftest's `family_model` fixture):
a family name -> a function returning a random transformers model of that family (3 layers and d_model 32,
the shape of conftest's GPT-2 so that tests written for it run unchanged; GQA where the family has it,
untied where the family is). Adding a family to every test above the model
is one line here. `every_family` runs an existing test that takes the `model` fixture on each of them:

>>> @every_family
... def test_something(model, tokens): ...

The configs themselves are conftest's `FAMILY_CONFIGS`, the ones the golden tests use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import pytest
import transformers

import lenskit
from tiny_tokenizer import VOCAB, make_tokenizer


def make_hf_family(family: str, **overrides) -> transformers.PreTrainedModel:
    """conftest's builder, imported on use: conftest imports this module to parametrise `family_model`."""
    from conftest import make_hf_family as build

    return build(family, **overrides)


# Each builder gets the vocabulary size of the tiny tokenizer, so text works on every family model.
FAMILY_BUILDERS: dict[str, Callable[[int], transformers.PreTrainedModel]] = {
    "gpt2": lambda vocab: make_hf_family("gpt2", vocab_size=vocab),
    "gpt_neox": lambda vocab: make_hf_family("gpt_neox", num_hidden_layers=3, vocab_size=vocab),
    "llama": lambda vocab: make_hf_family("llama", num_hidden_layers=3, vocab_size=vocab),
    "mistral": lambda vocab: make_hf_family("mistral", num_hidden_layers=3, vocab_size=vocab),
    "qwen2": lambda vocab: make_hf_family("qwen2", num_hidden_layers=3, vocab_size=vocab),
    "qwen3": lambda vocab: make_hf_family("qwen3", num_hidden_layers=3, vocab_size=vocab),
    "gemma2": lambda vocab: make_hf_family("gemma2", num_hidden_layers=3, vocab_size=vocab),
    "gemma3_text": lambda vocab: make_hf_family(
        "gemma3_text", num_hidden_layers=3, vocab_size=vocab,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "olmo2": lambda vocab: make_hf_family("olmo2", num_hidden_layers=3, vocab_size=vocab),
    "phi3": lambda vocab: make_hf_family("phi3", num_hidden_layers=3, vocab_size=vocab),
}


@dataclass(frozen=True)
class FamilyModel:
    """A family's transformers reference beside our model converted from it (sharing one tokenizer)."""

    family: str
    hf: transformers.PreTrainedModel
    model: lenskit.HookedTransformer


def build_family_model(family: str) -> FamilyModel:
    """A fresh pair (safe to modify)."""
    tokenizer = make_tokenizer()
    hf = FAMILY_BUILDERS[family](VOCAB)
    return FamilyModel(family, hf, lenskit.HookedTransformer.from_hf(hf, tokenizer=tokenizer))


@lru_cache(maxsize=None)
def family_model_of(family: str) -> FamilyModel:
    """The shared pair for `family`, built once per test session (tests must not modify it)."""
    return build_family_model(family)


# On a test that takes conftest's `model` fixture: run it on each family's tiny model instead of the GPT-2.
every_family = pytest.mark.parametrize("model", list(FAMILY_BUILDERS), indirect=True)

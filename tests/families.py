"""One tiny model per supported family, for running everything above the model on each of them.

`FAMILY_BUILDERS` is the one list the family-parametrised tests read (conftest's `family_model` fixture):
a family name -> a function returning a random transformers model of that family (2 layers, d_model 32,
GQA where the family has it, untied where the family is). Adding a family to every test above the model
is one line here. The configs themselves are conftest's `FAMILY_CONFIGS`, the ones the golden tests use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import transformers

import lenskit
from tiny_tokenizer import VOCAB, make_tokenizer


def make_hf_family(family: str, **overrides) -> transformers.PreTrainedModel:
    """conftest's builder, imported on use: conftest imports this module to parametrise `family_model`."""
    from conftest import make_hf_family as build

    return build(family, **overrides)


# Each builder gets the vocabulary size of the tiny tokenizer, so text works on every family model.
FAMILY_BUILDERS: dict[str, Callable[[int], transformers.PreTrainedModel]] = {
    "gpt2": lambda vocab: make_hf_family("gpt2", n_layer=2, vocab_size=vocab),
    "gpt_neox": lambda vocab: make_hf_family("gpt_neox", vocab_size=vocab),
    "llama": lambda vocab: make_hf_family("llama", vocab_size=vocab),
    "mistral": lambda vocab: make_hf_family("mistral", vocab_size=vocab),
    "qwen2": lambda vocab: make_hf_family("qwen2", vocab_size=vocab),
    "qwen3": lambda vocab: make_hf_family("qwen3", vocab_size=vocab),
}


@dataclass(frozen=True)
class FamilyModel:
    """A family's transformers reference beside our model converted from it (sharing one tokenizer)."""

    family: str
    hf: transformers.PreTrainedModel
    model: lenskit.HookedTransformer


def build_family_model(family: str) -> FamilyModel:
    tokenizer = make_tokenizer()
    hf = FAMILY_BUILDERS[family](VOCAB)
    return FamilyModel(family, hf, lenskit.HookedTransformer.from_hf(hf, tokenizer=tokenizer))

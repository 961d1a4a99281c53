"""One tiny model per supported family, for running everything above the model on each of them.

`FAMILY_BUILDERS` is the one list the family-parametrised tests read (conftest's `family_model` fixture):
a family name -> a function returning a random transformers model of that family (3 layers and d_model 32,
the shape of conftest's GPT-2 so that tests written for it run unchanged; GQA where the family has it,
untied where the family is). It derives from the registry (`lenskit.families`: each record's `tiny` config
with its `tiny_3_blocks` overrides), so a registered family is in every test above the model without a line
here. `every_family` runs an existing test that takes the `model` fixture on each of them:

>>> @every_family
... def test_something(model, tokens): ...

The configs themselves are conftest's `FAMILY_CONFIGS` (the registry's), the ones the golden tests use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import pytest
import transformers
from tiny_tokenizer import VOCAB, make_tokenizer

import lenskit
from lenskit.families import FAMILIES


def make_hf_family(family: str, **overrides) -> transformers.PreTrainedModel:
    """conftest's builder, imported on use: conftest imports this module to parametrise `family_model`."""
    from conftest import make_hf_family as build

    return build(family, **overrides)


def _builder(family: str) -> Callable[[int], transformers.PreTrainedModel]:
    return lambda vocab: make_hf_family(family, vocab_size=vocab, **FAMILIES[family].tiny_3_blocks)


# Families whose transformers class never ties lm_head to the embedding, whatever tie_word_embeddings says: they read
# as untied, and parity holds against the untied model transformers builds.
NEVER_TIED = {"nemotron_h"}

# Each builder gets the vocabulary size of the tiny tokenizer, so text works on every family model.
FAMILY_BUILDERS: dict[str, Callable[[int], transformers.PreTrainedModel]] = {t: _builder(t) for t in FAMILIES}


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


def held_beside_the_stream(model: lenskit.HookedTransformer, tokens) -> list:
    """Hooks that hold what Gemma 4 E2B/E4B's blocks read beside the residual stream at its values on `tokens`: each
    block's per-layer input (from the tokens themselves) and the keys and values a kv-sharing block reads from an
    earlier block. Under them the stream alone carries a run from one block to the next, as it does in every other
    family (for which this is empty): what patching identities such as "the whole stream patched in gives the
    source run back" need."""
    cfg = model.cfg
    names = [n for n in model.hook_dict if n.endswith(".hook_per_layer_in")]
    names += [f"blocks.{i}.attn.hook_{kv}" for i in range(cfg.n_layers) if cfg.kv_source(i) is not None for kv in "kv"]
    if not names:
        return []
    _, cache = model.run_with_cache(tokens, names_filter=names)
    return [(name, lambda x, hook, held=cache[name]: held.clone()) for name in names]

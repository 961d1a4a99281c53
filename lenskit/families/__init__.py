"""The registry of supported model families: one `Family` record per Hugging Face `model_type`, each in its own module.

`lenskit.families.<model_type>` (`llama.py`, `gemma4_text.py`, ...) holds everything lenskit knows about one family:
its config reader (`read`) and writer (`write`), its checkpoint layout (`LAYOUT`), its published shapes (`PRESETS`),
the tiny random config the tests build (`TINY`) and the record made of them (`FAMILY`, a `family.Family`). What
several families share has one home beside them: `readers.py`, `writers.py`, `layouts.py`, `presets.py` (the
Llama-like and Gemma-like parts, routed experts), `rope.py` (rotary settings) and `fields.py` (typed config access).

Everything else derives from `FAMILIES`, registered below in one place: the loader's dispatch, the list of supported
types in the refusal message, `lenskit.PRESETS`, `lenskit info`'s help, tests/families.py's parametrisation and the
README check. Adding a family whose pieces exist is one module here and its line in `_MODULES` (docs/architecture.md,
"Adding a family").

>>> family_of("llama").hf_class
'LlamaForCausalLM'
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..config import ModelConfig, register_families
from . import (
    apertus,
    deepseek_v3,
    falcon_h1,
    gemma2,
    gemma3_text,
    gemma4_text,
    glm4_moe,
    gpt2,
    gpt_neox,
    gpt_oss,
    granitemoehybrid,
    llama,
    llama4_text,
    mistral,
    mixtral,
    nemotron_h,
    olmo2,
    olmo3,
    olmoe,
    phi3,
    qwen2,
    qwen3,
    qwen3_5_text,
    qwen3_moe,
    qwen3_next,
    smollm3,
)
from .family import Family
from .readers import read_config

__all__ = ["FAMILIES", "PRESETS", "Family", "config_fields", "family_of"]

# The one list of family modules, in the README's order; each module's name is its model_type.
_MODULES = (gpt2, gpt_neox, llama, mistral, qwen2, qwen3, gemma2, gemma3_text, olmo2, phi3, mixtral, qwen3_moe, olmoe,
            gpt_oss, olmo3, smollm3, qwen3_5_text, gemma4_text, apertus, deepseek_v3, qwen3_next, llama4_text,
            falcon_h1, glm4_moe, nemotron_h, granitemoehybrid)

FAMILIES: dict[str, Family] = {m.FAMILY.model_type: m.FAMILY for m in _MODULES}

PRESETS: dict[str, ModelConfig] = {name: cfg for f in FAMILIES.values() for name, cfg in f.presets.items()}
"""Published shapes by short name (case-insensitive; an organisation prefix is ignored by `ModelConfig.from_name`)."""


def family_of(model_type: Any) -> Family:
    """The record of `model_type`; an unknown one is refused, listing the supported types."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not supported; lenskit implements {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def config_fields(d: Mapping[str, Any], tensor_names: Iterable[str] | None = None) -> dict[str, Any]:
    """`ModelConfig` keyword arguments for a Hugging Face config dict, or a one-line error naming the field.
    With the checkpoint's `tensor_names`, a layer count above the blocks they hold is refused before anything is
    built per layer, so a config claiming a million layers is refused at once."""
    try:
        family = family_of(d.get("model_type"))
    except ValueError as e:
        raise ValueError(f"config field {e}") from None
    n_blocks = None if tensor_names is None else family.layout.block_count(tensor_names)
    return read_config(d, family.model_type, family.read, n_blocks)


register_families(presets=PRESETS, config_fields=config_fields, family_of=family_of)  # ModelConfig looks them up there

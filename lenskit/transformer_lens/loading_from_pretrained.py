"""`transformer_lens.loading_from_pretrained`: the name look-ups that work offline, over what lenskit knows.

`OFFICIAL_MODEL_NAMES` are the names lenskit loads without a folder path: its embedded models (`stdlib-gpt2`,
`stdlib-llama`) and its presets' names (`gpt2`, `pythia-70m`, `llama-3.2-1b` ...: lenskit.families). TransformerLens's
table lists hub ids; a hub id is found here only where lenskit's preset has that name. `convert_hf_model_config` and
`get_pretrained_model_config` read a name's config (preset, embedded model, local folder or cached hub folder)
without a download, in TransformerLens's field names. Training-checkpoint labels (`get_checkpoint_labels`) need the
hub and are refused in one line.

>>> from lenskit.transformer_lens.loading_from_pretrained import get_official_model_name, convert_hf_model_config
>>> get_official_model_name("GPT2-small")
'gpt2'
>>> convert_hf_model_config("gpt2")["d_mlp"]
3072
"""

from __future__ import annotations

import os
from typing import Any

from ..config import ModelConfig
from ..families import PRESETS
from ..io.hub import EMBEDDED_MODELS, resolve_model_folder
from .errors import ValueAssertionError
from .HookedTransformerConfig import HookedTransformerConfig


def _official_names() -> list[str]:
    return [*EMBEDDED_MODELS, *PRESETS]


OFFICIAL_MODEL_NAMES: list[str] = _official_names()
# TransformerLens's short aliases for the models both know (its table has many more, for models lenskit has no
# preset of).
MODEL_ALIASES: dict[str, list[str]] = {
    "gpt2": ["gpt2-small"], "stdlib-gpt2": ["stdlib"],
    **{name: [f"{name}-deduped"] for name in OFFICIAL_MODEL_NAMES if name.startswith("pythia-")},
}


def make_model_alias_map() -> dict[str, str]:
    """Every official name and alias, lower-cased -> the official name."""
    table = {name.lower(): name for name in OFFICIAL_MODEL_NAMES}
    table.update({alias.lower(): name for name, aliases in MODEL_ALIASES.items() for alias in aliases})
    return table


def get_official_model_name(model_name: str) -> str:
    """The official name of `model_name` or an alias (case-insensitive). An unknown name raises the ValueError
    TransformerLens raises (also an AssertionError, as the namespace's refusals are), naming the closest names."""
    official = make_model_alias_map().get(str(model_name).lower())
    if official is None:
        import difflib

        close = difflib.get_close_matches(str(model_name).lower(), list(make_model_alias_map()), n=3, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise ValueAssertionError(f"{model_name!r} is not a name lenskit knows (embedded models and presets, "
                                  f"OFFICIAL_MODEL_NAMES){hint}; pass a local folder instead")
    return official


def _model_config(name_or_path: str | os.PathLike) -> ModelConfig:
    text = str(name_or_path)
    known = make_model_alias_map().get(text.lower())
    if known in PRESETS:
        return PRESETS[known]
    return ModelConfig.from_json(resolve_model_folder(known or text) / "config.json")


def convert_hf_model_config(model_name: str | os.PathLike, **kwargs: Any) -> dict[str, Any]:
    """The architecture of a preset, embedded model or local folder as TransformerLens's config fields (offline)."""
    return tl_fields(_model_config(model_name))


def tl_fields(cfg: ModelConfig) -> dict[str, Any]:
    """A lenskit config's architecture in TransformerLens's field names."""
    gated = cfg.mlp.startswith(("swiglu", "geglu"))
    return {
        "d_model": cfg.d_model, "d_head": cfg.d_head, "n_heads": cfg.n_heads, "d_mlp": cfg.d_mlp,
        "n_layers": cfg.n_layers, "n_ctx": cfg.n_ctx, "d_vocab": cfg.d_vocab, "eps": cfg.norm_eps,
        "act_fn": "silu" if cfg.mlp.startswith("swiglu") else cfg.activation,
        "normalization_type": "LN" if cfg.norm == "layernorm" else "RMS",
        "positional_embedding_type": cfg.positional_embedding_type,
        "rotary_dim": cfg.rope.dim, "rotary_base": cfg.rope.base, "n_key_value_heads": cfg.n_kv_heads,
        "gated_mlp": gated, "parallel_attn_mlp": cfg.parallel_block, "tie_word_embeddings": cfg.tie_word_embeddings,
        "original_architecture": cfg.family, "output_logits_soft_cap": cfg.final_softcap or -1.0,
        "attn_scores_soft_cap": cfg.attention.softcap or -1.0, "num_experts": cfg.moe.n_experts,
        "experts_per_token": cfg.moe.n_experts_per_token,
    }


def get_pretrained_model_config(model_name: str | os.PathLike, **kwargs: Any) -> HookedTransformerConfig:
    """`convert_hf_model_config` as a `HookedTransformerConfig` (the fields it has), for building a model of that
    shape: `HookedTransformer(get_pretrained_model_config("gpt2"))`. Extra keyword fields override."""
    fields = set(HookedTransformerConfig.__dataclass_fields__)
    values = {k: v for k, v in convert_hf_model_config(model_name).items() if k in fields}
    return HookedTransformerConfig(**{**values, "model_name": str(model_name), **kwargs})


def get_checkpoint_labels(model_name: str, **kwargs: Any) -> tuple[list[int], str]:
    """Refused: the checkpoint schedules of TransformerLens's training runs are read from the hub."""
    raise ValueError(f"get_checkpoint_labels({model_name!r}): training-checkpoint schedules come from the hub, which "
                     "lenskit does not reach; load each checkpoint's folder with from_pretrained(path)")

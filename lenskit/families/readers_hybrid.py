"""The config reader of Qwen 3.5's text model: Gated DeltaNet linear-attention blocks between gated full-attention
ones (lenskit.pieces.deltanet), on the dense readers' attention and norm fields (`readers.py`)."""

from __future__ import annotations

from collections import ChainMap
from typing import Any

from .fields import ConfigReader
from .readers import llama_like


_HYBRID_LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def read_qwen3_5_text(r: ConfigReader) -> dict[str, Any]:
    """Qwen 3.5's text model: Gated DeltaNet blocks and, every `full_attention_interval`-th, gated full attention
    (per-head q/k norms, partial rotary), with (1 + w) RMSNorms. Its rotary settings' `mrope_section` and
    `mrope_interleaved` share the rotary dims between text, height and width positions; a text prompt gives all
    three the same position, so they leave the function unchanged and are typed only."""
    r.require("attention_bias", (False,), False)
    r.require("attn_output_gate", (True,), True)  # Qwen3-Next's switch: transformers' Qwen 3.5 always gates
    stripped = {}  # the rotary settings without the mrope fields; every other field is read from r.d itself
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(r.d.get(key), dict):
            sub = ConfigReader(r.d[key], r.family, where=f"{key}.")
            section = sub.d.get("mrope_section")
            if section is not None and (not isinstance(section, list) or any(
                    isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in section)):
                raise ValueError(f"config field {key}.mrope_section={section!r} must be a list of non-negative ints "
                                 f"(model_type={r.family!r})")
            sub.bool("mrope_interleaved", False)
            stripped[key] = {k: v for k, v in r.d[key].items() if k not in _MROPE_KEYS}
    fields = llama_like(ConfigReader(ChainMap(stripped, r.d), r.family, r.n_blocks), False, False, False, eps=1e-6, bos=None, eos=None,
                         kv_heads=4, head_dim=256, null_head_dim=False, null_kv_heads=False, rope_types=("default",),
                         default_fraction=0.25)
    n = fields["n_layers"]
    types = r.d.get("layer_types")
    if types is None:
        every = r.int("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in _HYBRID_LAYER_TYPES for t in types):
        raise ValueError(f"config field layer_types={types!r} must list one of {sorted(_HYBRID_LAYER_TYPES)} for each of "
                         f"the {n} layers (model_type={r.family!r})")
    types = tuple(_HYBRID_LAYER_TYPES[t] for t in types)
    linear = dict(linear_n_k_heads=r.int("linear_num_key_heads", 16), linear_n_v_heads=r.int("linear_num_value_heads", 32),
                  linear_d_k=r.int("linear_key_head_dim", 128), linear_d_v=r.int("linear_value_head_dim", 128),
                  linear_conv_width=r.int("linear_conv_kernel_dim", 4))
    if linear["linear_n_v_heads"] % linear["linear_n_k_heads"]:
        raise ValueError(f"config fields linear_num_value_heads={linear['linear_n_v_heads']} and linear_num_key_heads="
                         f"{linear['linear_n_k_heads']}: each key head serves a whole group of value heads, so the first "
                         f"must be a multiple of the second (model_type={r.family!r}); fix config.json")
    return {**fields, "norm": "rmsnorm_offset", "qk_norm": True, "attn_output_gate": True, "layer_types": types,
            **(linear if "linear" in types else {})}

"""The config fields of Gemma 4's smaller and sparse sizes, read for `readers.read_gemma4_text`: per-layer inputs (E2B,
E4B), kv sharing (E2B, E4B) and experts beside the dense MLP (26B-A4B). Each is read as transformers 5's
`Gemma4TextConfig` reads it, and a value transformers' model could not run is refused by name."""

from __future__ import annotations

from typing import Any

from ..config_checks import kv_sources
from .fields import ConfigReader


def gemma4_extras(r: ConfigReader, n_layers: int, types: tuple[str, ...]) -> dict[str, Any]:
    """`ModelConfig` fields from `hidden_size_per_layer_input` (0: none; transformers' default is 256) and
    `vocab_size_per_layer_input`, `num_kv_shared_layers` and `use_double_wide_mlp` (it widens only the sharing
    blocks), `enable_moe_block` with `num_experts`, `top_k_experts` and `moe_intermediate_size`. `types`: the
    blocks' layer types as the model runs them."""
    d_per_layer = r.int("hidden_size_per_layer_input", 256, positive=False)
    vocab = r.int("vocab_size_per_layer_input", 262144)  # read, and checked below, only where there are such inputs
    if d_per_layer and vocab < r.d.get("vocab_size", 0):
        raise ValueError(f"config field vocab_size_per_layer_input={vocab} is below vocab_size={r.d['vocab_size']}: "
                         f"a token past it has no per-layer input (model_type={r.family!r}); fix config.json")
    shared = r.int("num_kv_shared_layers", 0, positive=False)
    if shared >= n_layers:
        raise ValueError(f"config field num_kv_shared_layers={shared}: with num_hidden_layers={n_layers} no block would "
                         "compute the keys the sharing blocks read (transformers' model fails on it); share fewer "
                         f"blocks (model_type={r.family!r})")
    sources = kv_sources(n_layers, shared, types) if shared else ()
    orphan = next((i for i in range(n_layers - shared, n_layers) if shared and sources[i] is None), None)
    if orphan is not None:
        raise ValueError(f"config field num_kv_shared_layers={shared}: block {orphan} ({types[orphan]}) would read the "
                         f"keys of the last earlier block of its type, but no block before {n_layers - shared} has that "
                         f"type (transformers refuses it too); fix layer_types or share fewer blocks "
                         f"(model_type={r.family!r})")
    double = r.bool("use_double_wide_mlp", False)
    return {"d_per_layer": d_per_layer or None, "d_vocab_per_layer": vocab if d_per_layer else None,
            "n_kv_shared_layers": shared, "double_wide_mlp": double and shared > 0, **_experts(r)}


def _experts(r: ConfigReader) -> dict[str, Any]:
    """The experts beside each block's MLP (`enable_moe_block`); their fields are typed only where it is off."""
    on = r.bool("enable_moe_block", False)
    sizes = {key: r.int(key, None) for key in ("num_experts", "top_k_experts", "moe_intermediate_size")}
    if not on:
        return {"experts_beside_mlp": False}
    absent = [key for key, value in sizes.items() if value is None]
    if absent:
        raise ValueError(f"config field enable_moe_block=True needs {', '.join(absent)}, which config.json leaves "
                         f"unset (transformers' model fails without them; model_type={r.family!r})")
    if sizes["top_k_experts"] > sizes["num_experts"]:
        raise ValueError(f"config field top_k_experts={sizes['top_k_experts']} exceeds num_experts="
                         f"{sizes['num_experts']}: each token is routed to k of the experts (model_type={r.family!r})")
    return {"experts_beside_mlp": True, "n_experts": sizes["num_experts"], "n_experts_per_token": sizes["top_k_experts"],
            "d_expert": sizes["moe_intermediate_size"], "routing": "softmax_topk_renorm"}

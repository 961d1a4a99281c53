"""SmolLM3 (`smollm3`): Llama's block without rotary in some blocks (every fourth by default)."""

from __future__ import annotations

from typing import Any

from ..config import ROPE_TYPES, ModelConfig
from . import writers
from .family import TINY_SHAPE, Family
from .fields import ConfigReader
from .layouts import LLAMA
from .presets import llama_preset, named_presets
from .readers import llama_like, nope_layers, read_layer_types


def read(r: ConfigReader) -> dict[str, Any]:
    """Llama with no rotary in some blocks (every fourth by default); with `use_sliding_window`, those blocks are the
    sliding-window ones. A block is sliding where `layer_types` says so, as transformers' masks make it."""
    bias = r.bool("attention_bias", False)
    fields = llama_like(r, bias, bias, r.bool("mlp_bias", False), eps=1e-6, bos=128000, eos=128001, kv_heads=4,
                        rope_types=ROPE_TYPES + ("yarn",), default_theta=2_000_000.0)  # YaRN: its card's long context
    n = fields["n_layers"]
    nope = nope_layers(r, n)
    use_window, window = r.bool("use_sliding_window", False), r.int("sliding_window", None)
    if r.d.get("layer_types") is None:
        types = tuple("sliding" if use_window and window is not None and i in nope else "full" for i in range(n))
    else:
        types = read_layer_types(r, n, pattern=1)
    if "sliding" in types and window is None:
        raise ValueError("config field sliding_window=None, but layer_types has sliding-window blocks; give the window "
                         f"(model_type={r.family!r})")
    sliding = "sliding" in types
    return {**fields, "tie_word_embeddings": r.bool("tie_word_embeddings", True), "nope_layers": nope,
            "layer_types": types if sliding else None, "sliding_window": window if sliding else None}


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg), "attention_bias": cfg.attention.qkv_bias, "mlp_bias": cfg.mlp_bias,
            "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.n_layers)],
            "use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "layer_types": writers.hf_layer_types(cfg)}


LAYOUT = LLAMA

# HuggingFaceTB/SmolLM3-3B's config.json (from memory, not downloaded): every fourth block without rotary
PRESETS = named_presets(llama_preset("smollm3-3b", "smollm3", 36, 2048, 16, 4, 11008, 128256, 65536, True, 5_000_000.0,
                                     nope_layers=tuple(range(3, 36, 4)), bos_token_id=None, eos_token_id=128012))

TINY = dict(TINY_SHAPE, num_key_value_heads=2, no_rope_layer_interval=2, pad_token_id=0)  # block 1 (of 2 or 3): no rotary

FAMILY = Family("smollm3", "SmolLM3ForCausalLM", "SmolLM3Config", "SmolLM3", read, write, LAYOUT, PRESETS, TINY)

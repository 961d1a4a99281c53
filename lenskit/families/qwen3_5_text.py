"""Qwen 3.5's text model (`qwen3_5_text`, dense): Gated DeltaNet linear-attention blocks (lenskit.pieces.deltanet)
between gated full-attention ones, on Llama's projections and names, with (1 + w) RMSNorms."""

from __future__ import annotations

from collections import ChainMap
from typing import Any

from ..config import ModelConfig
from . import writers
from .family import TINY_SHAPE, Family
from .fields import ConfigReader
from .layouts import LLAMA, LLAMA_BLOCK, Layout
from .presets import named_presets
from .readers import llama_like

_HYBRID_LAYER_TYPES = {"linear_attention": "linear", "full_attention": "full"}
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def read(r: ConfigReader) -> dict[str, Any]:
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
    fields = llama_like(ConfigReader(ChainMap(stripped, r.d), r.family, r.n_blocks), False, False, False, eps=1e-6,
                        bos=None, eos=None, kv_heads=4, head_dim=256, null_head_dim=False, null_kv_heads=False,
                        rope_types=("default",), default_fraction=0.25)
    return {**fields, "norm": "rmsnorm_offset", "qk_norm": True, "attn_output_gate": True,
            **linear_attention_fields(r, fields["n_layers"])}


def linear_attention_fields(r: ConfigReader, n: int) -> dict[str, Any]:
    """The Qwen hybrids' block kinds (`layer_types`, or every `full_attention_interval`-th block full attention, the
    rest Gated DeltaNet) and, where there is a linear block, its shape (Qwen 3.5 and Qwen3-Next share both)."""
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
    return {"layer_types": types, **(linear if "linear" in types else {})}


def linear_attention_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields `linear_attention_fields` reads, for saving."""
    linear = {} if cfg.linear.n_k_heads is None else {
        "linear_num_key_heads": cfg.linear.n_k_heads, "linear_num_value_heads": cfg.linear.n_v_heads,
        "linear_key_head_dim": cfg.linear.d_k, "linear_value_head_dim": cfg.linear.d_v,
        "linear_conv_kernel_dim": cfg.linear.conv_width}
    types = cfg.layer_types or ("full",) * cfg.n_layers
    return {"layer_types": [writers.hf_layer_type(t) for t in types], **linear}


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {**writers.llama_like(cfg), "attention_bias": cfg.attention.qkv_bias,
            "rope_parameters": writers.rope_parameters(cfg, partial=True), **linear_attention_config(cfg)}


# Qwen 3.5: full-attention blocks as Llama's (`self_attn`; its q_proj holds each head's query and gate rows), the
# Gated DeltaNet blocks under `linear_attn`.
DELTANET_BLOCK = {f"attn.{ours}": f"linear_attn.{theirs}" for ours, theirs in (
    ("conv_weight", "conv1d.weight"), ("A_log", "A_log"), ("dt_bias", "dt_bias"), ("out_norm.weight", "norm.weight"),
    ("out_proj.weight", "out_proj.weight"))}  # what Qwen 3.5 and Qwen3-Next name alike
_BLOCK = {
    **LLAMA_BLOCK, **DELTANET_BLOCK,
    **{f"attn.{ours}": f"linear_attn.{theirs}" for ours, theirs in (
        ("in_qkv.weight", "in_proj_qkv.weight"), ("in_z.weight", "in_proj_z.weight"), ("in_b.weight", "in_proj_b.weight"),
        ("in_a.weight", "in_proj_a.weight"))},
}
LAYOUT = Layout(prefix="model.", blocks="layers", top=LLAMA.top, block=_BLOCK)


def _preset(name: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_mlp: int, n_v_heads: int,
            tied: bool) -> ModelConfig:
    """Qwen 3.5 (dense), the text part of Qwen/Qwen3.5-*'s config.json (`text_config`; shapes from the published
    configs as recalled, cross-checked against Qwen3_5TextConfig's defaults, which are the 9B's): three Gated DeltaNet
    blocks (16 q/k heads of 128, value heads of 128) then one gated full-attention block (heads of 256, a quarter
    of each rotating, base 1e7), (1 + w) RMSNorms, a 248,320-token vocabulary, 262,144 positions."""
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=256, d_mlp=d_mlp,
        d_vocab=248320, n_ctx=262144, norm="rmsnorm_offset", norm_eps=1e-6, mlp="swiglu", tie_word_embeddings=tied,
        family="qwen3_5_text", positional="rotary", rotary_base=10_000_000.0, rotary_dim=64, fused_qkv=False,
        qkv_bias=False, out_bias=False, qk_norm=True, attn_output_gate=True,
        layer_types=tuple("full" if (i + 1) % 4 == 0 else "linear" for i in range(n_layers)), linear_n_k_heads=16,
        linear_n_v_heads=n_v_heads, linear_d_k=128, linear_d_v=128, linear_conv_width=4, eos_token_id=248044, name=name,
    )


PRESETS = named_presets(_preset("qwen3.5-0.8b", 24, 1024, 8, 2, 3584, 16, True),
                        _preset("qwen3.5-2b", 24, 2048, 8, 2, 6144, 16, True),
                        _preset("qwen3.5-4b", 32, 2560, 16, 4, 9216, 32, True),
                        _preset("qwen3.5-9b", 32, 4096, 16, 4, 12288, 32, False),
                        _preset("qwen3.5-27b", 64, 5120, 24, 4, 17408, 48, False))

# A gated full-attention block then a Gated DeltaNet one, and with 3 blocks linear, full, linear (the tests look at the
# heads of block 0 of the first, block 1 of the second); two q/k heads serving four value heads, d_k != d_v, half of
# each attention head rotating, mrope sections (which text positions make moot), weights large enough that the linear
# blocks' writes matter, room for prompts longer than the 64-position chunk.
TINY = dict(TINY_SHAPE, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
            layer_types=["full_attention", "linear_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True))

FAMILY = Family("qwen3_5_text", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", "Qwen 3.5 (text only)", read, write, LAYOUT,
                PRESETS, TINY,
                tiny_3_blocks=dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"]))

"""Falcon-H1 (`falcon_h1`): in every block, attention and a Mamba-2 mixer (lenskit.pieces.mamba2) read ln1's output
side by side and their writes are summed (lenskit.pieces.layers.MambaBesideAttentionBlock), then a SwiGLU MLP; Llama's
attention and MLP names, RMSNorms, rotary positions. Its muP multipliers are applied as transformers applies them, to
activations, never folded into weights: the embedding's, the logits', attention's input, keys and write, the MLP's gate
and write (`cfg.scales`), and the mixer's input, in_proj parts and write (`cfg.mamba`)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import writers
from .family import TINY_SHAPE, Family
from .fields import REFUSED, ConfigReader
from .layouts import LLAMA, LLAMA_BLOCK, Layout
from .presets import named_presets
from .readers import common_fields, read_head_dim, read_heads, read_kv_heads
from .rope import rope

# mamba_rms_norm, mamba_norm_before_gate -> how the scan's output meets its gate (lenskit.pieces.mamba2)
_NORMS = {(False, False): "gate_only", (False, True): "gate_only", (True, True): "norm_then_gate",
          (True, False): "gate_then_norm"}


def _multipliers(r: ConfigReader, key: str, n: int) -> tuple[float, ...]:
    """A list of `n` finite multipliers; absent or null: all 1.0, as transformers fills it."""
    value = r.d.get(key)
    if value is None:
        return (1.0,) * n
    if not isinstance(value, (list, tuple)) or len(value) != n or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) < float("inf") for v in value):
        raise ValueError(f"config field {key}={value!r} must be a list of {n} finite numbers (model_type={r.family!r})")
    return tuple(float(v) for v in value)


# transformers' config files spell a float JSON cannot hold as {"__float__": "Infinity"} (time_step_limit's usual upper
# end); read from a dict rather than through transformers' file reader, the tag is still there
_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _tag(value: Any) -> str | None:
    """The tag of transformers' spelling of a special float, {"__float__": "Infinity"}; None for anything else."""
    return value["__float__"] if isinstance(value, dict) and set(value) == {"__float__"} else None


def read(r: ConfigReader) -> dict[str, Any]:
    r.require("hidden_act", ("silu",), "silu")  # the MLP's and the mixer's convolution's activation
    # remote-code fields of the first releases: attention in every block, and an MLP in every block
    r.require("attn_layer_indices", (None,), None)
    r.require("mamba_use_mlp", (True,), True)
    r.int("num_logits_to_keep", 1, null=None)  # typed only: generation's logits, not the forward's
    n_layers = r.n_layers("num_hidden_layers")
    d_model, n_heads = read_heads(r, "hidden_size", "num_attention_heads", must_divide=False)
    d_head = read_head_dim(r, d_model, n_heads, None)
    fields = rope(r, d_head, types=("default",))
    if fields["rotary_dim"] != d_head:  # transformers' Falcon-H1 rotates every feature of a head, whatever it says
        raise ValueError(f"config field partial_rotary_factor: transformers' falcon_h1 rotates all head_dim={d_head} "
                         f"features and ignores it; remove it (model_type={r.family!r})")
    d_ssm = r.int("mamba_d_ssm", 1024, null=None)
    d_ssm = r.int("mamba_expand", 2) * d_model if d_ssm is None else d_ssm
    n_ssm_heads = r.int("mamba_n_heads", 128)
    d_ssm_head = r.d.get("mamba_d_head", "auto")
    d_ssm_head = d_ssm // n_ssm_heads if d_ssm_head == "auto" else r.int("mamba_d_head")
    if n_ssm_heads * d_ssm_head != d_ssm:
        raise ValueError(f"config fields mamba_n_heads={n_ssm_heads} x mamba_d_head={d_ssm_head} must equal the mixer's "
                         f"width mamba_d_ssm={d_ssm} (model_type={r.family!r}); transformers refuses it too")
    given = r.d.get("time_step_limit")
    limit = [0.0, float("inf")] if given is None else [_FLOAT_TAGS.get(_tag(v), v) for v in given] \
        if isinstance(given, (list, tuple)) else given
    if not isinstance(limit, list) or len(limit) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                                             for v in limit):
        raise ValueError(f"config field time_step_limit={given!r} must be [min, max] (model_type={r.family!r})")
    bias = r.bool("attention_bias", False)
    norm = _NORMS[r.bool("mamba_rms_norm", False), r.bool("mamba_norm_before_gate", True)]
    gate, down = _multipliers(r, "mlp_multipliers", 2)
    return {
        **common_fields(r, bos=1, eos=2),
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads, "d_head": d_head,
        "n_kv_heads": read_kv_heads(r, n_heads, 8), "d_vocab": r.int("vocab_size"),
        "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("rms_norm_eps", 1e-5, positive=True), "norm": "rmsnorm", "mlp": "swiglu",
        "tie_word_embeddings": r.bool("tie_word_embeddings", False), "fused_qkv": False, "qkv_bias": bias,
        "out_bias": bias, "mlp_bias": r.bool("mlp_bias", False), **fields,
        "mamba_beside_attention": True, "mamba_n_heads": n_ssm_heads, "mamba_d_head": d_ssm_head,
        "mamba_d_state": r.int("mamba_d_state", 256), "mamba_n_groups": r.int("mamba_n_groups", 1),
        "mamba_conv_width": r.int("mamba_d_conv", 4), "mamba_conv_bias": r.bool("mamba_conv_bias", True),
        "mamba_in_bias": r.bool("mamba_proj_bias", False), "mamba_out_bias": r.bool("projectors_bias", False),
        "mamba_chunk_size": r.int("mamba_chunk_size", 256), "mamba_dt_min": float(limit[0]),
        "mamba_dt_max": float(limit[1]), "mamba_norm": norm,
        "mamba_in_multiplier": r.float("ssm_in_multiplier", 1.0, null=REFUSED),
        "mamba_multipliers": _multipliers(r, "ssm_multipliers", 5),
        "mamba_out_multiplier": r.float("ssm_out_multiplier", 1.0, null=REFUSED),
        "embedding_multiplier": r.float("embedding_multiplier", 1.0, null=REFUSED),
        "logits_multiplier": r.float("lm_head_multiplier", 1.0, null=REFUSED),
        "attention_in_multiplier": r.float("attention_in_multiplier", 1.0, null=REFUSED),
        "key_multiplier": r.float("key_multiplier", 1.0, null=REFUSED),
        "attention_out_multiplier": r.float("attention_out_multiplier", 1.0, null=REFUSED),
        "mlp_gate_multiplier": gate, "mlp_down_multiplier": down,
    }


def write(cfg: ModelConfig) -> dict[str, Any]:
    m, s = cfg.mamba, cfg.scales
    rms, before = {"gate_only": (False, False), "norm_then_gate": (True, True), "gate_then_norm": (True, False)}[m.norm]
    return {
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
        "hidden_act": "silu", "max_position_embeddings": cfg.n_ctx, "rms_norm_eps": cfg.norm_eps,
        **writers.common_fields(cfg), "rope_parameters": writers.rope_parameters(cfg),
        "attention_bias": cfg.attention.qkv_bias, "mlp_bias": cfg.mlp_bias, "attention_dropout": 0.0,
        "mamba_d_ssm": m.n_heads * m.d_head, "mamba_n_heads": m.n_heads, "mamba_d_head": m.d_head,
        "mamba_n_groups": m.n_groups, "mamba_d_state": m.d_state, "mamba_d_conv": m.conv_width,
        "mamba_chunk_size": m.chunk_size, "mamba_conv_bias": m.conv_bias, "mamba_proj_bias": m.in_bias,
        "projectors_bias": m.out_bias, "mamba_rms_norm": rms, "mamba_norm_before_gate": before,
        "time_step_limit": [m.dt_min, m.dt_max],  # inf as a float: the file writer spells it, as transformers' does
        "embedding_multiplier": s.embedding, "lm_head_multiplier": s.logits,
        "attention_in_multiplier": s.attention_in, "key_multiplier": s.key, "attention_out_multiplier": s.attention_out,
        "mlp_multipliers": [s.mlp_gate, s.mlp_down], "ssm_in_multiplier": m.in_multiplier,
        "ssm_multipliers": list(m.multipliers), "ssm_out_multiplier": m.out_multiplier,
    }


_MIXER = {"in_proj.weight": "in_proj.weight", "in_proj.bias": "in_proj.bias", "conv_weight": "conv1d.weight",
          "conv_bias": "conv1d.bias", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D", "norm.weight": "norm.weight",
          "out_proj.weight": "out_proj.weight", "out_proj.bias": "out_proj.bias"}
_BLOCK = {
    **{ours: theirs for ours, theirs in LLAMA_BLOCK.items() if ours.startswith("attn.") and "_norm" not in ours},
    "ln1.weight": "input_layernorm.weight", "ln2.weight": "pre_ff_layernorm.weight",
    **{f"mlp.{ours}.{p}": f"feed_forward.{theirs}.{p}" for ours, theirs in (("gate", "gate_proj"), ("fc_in", "up_proj"),
                                                                          ("fc_out", "down_proj")) for p in ("weight", "bias")},
    **{f"mamba.{ours}": f"mamba.{theirs}" for ours, theirs in _MIXER.items()},
}
LAYOUT = Layout(prefix="model.", blocks="layers",
                top={**LLAMA.top, "ln_final.weight": "final_layernorm.weight"}, block=_BLOCK, buffers=r"^layers\.\d+\.mamba\.mup_vector$")


def _preset(name: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_head: int, d_mlp: int,
            n_ssm_heads: int, d_ssm_head: int, d_state: int, d_vocab: int, n_ctx: int) -> ModelConfig:
    """Falcon-H1's shape (tiiuae/Falcon-H1-*'s config.json as recalled, cross-checked against the published parameter
    counts): GQA heads with an explicit head_dim, rotary base 1e11, a Mamba-2 mixer of one group with a 4-wide
    convolution and no gated norm, untied embeddings. The muP multipliers differ per checkpoint and are read from its
    config.json; a preset leaves them at 1.0 (the shape is what info, accounting and random models need)."""
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head, d_mlp=d_mlp,
        d_vocab=d_vocab, n_ctx=n_ctx, norm="rmsnorm", norm_eps=1e-5, mlp="swiglu", tie_word_embeddings=False,
        family="falcon_h1", positional="rotary", rotary_base=1e11, fused_qkv=False, qkv_bias=False, out_bias=False,
        mlp_bias=False, mamba_beside_attention=True, mamba_n_heads=n_ssm_heads, mamba_d_head=d_ssm_head,
        mamba_d_state=d_state, mamba_n_groups=1, mamba_conv_width=4, mamba_conv_bias=True, mamba_chunk_size=128,
        mamba_norm="gate_only", bos_token_id=1, eos_token_id=11, name=name,
    )


PRESETS = named_presets(
    _preset("falcon-h1-0.5b", 36, 1024, 8, 2, 64, 2048, 24, 64, 128, 32784, 16384),
    _preset("falcon-h1-1.5b", 24, 2048, 8, 2, 128, 4608, 48, 64, 256, 65536, 131072),
    _preset("falcon-h1-1.5b-deep", 66, 1280, 6, 2, 128, 3072, 24, 64, 256, 65536, 131072),
    _preset("falcon-h1-3b", 32, 2560, 10, 2, 128, 6144, 32, 128, 256, 65536, 131072),
    _preset("falcon-h1-7b", 44, 3072, 12, 2, 128, 12288, 24, 128, 256, 130048, 262144),
    _preset("falcon-h1-34b", 72, 5120, 20, 4, 128, 21504, 32, 128, 256, 261120, 262144),
)

# GQA heads of 16 (wider than d_model / heads, as Falcon-H1's are), a mixer of 4 heads of 8 in 2 groups with a state
# of 8, the published norm (none) and every multiplier away from 1 so that each one's place is tested; chunks of 8
# positions so a prompt spans several; weights large enough that the mixer's write matters.
TINY = dict(TINY_SHAPE, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
            mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
            mamba_chunk_size=8, mamba_rms_norm=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            embedding_multiplier=2.5, lm_head_multiplier=0.75, attention_in_multiplier=1.25, key_multiplier=0.5,
            attention_out_multiplier=0.8, ssm_in_multiplier=1.5, ssm_out_multiplier=0.6,
            ssm_multipliers=[0.7, 1.3, 0.9, 1.1, 0.5], mlp_multipliers=[1.2, 0.7])

FAMILY = Family("falcon_h1", "FalconH1ForCausalLM", "FalconH1Config", "Falcon-H1 (0.5B to 34B)", read, write, LAYOUT, PRESETS, TINY)

"""Gemma 4's text model (`gemma4_text`: E2B, E4B, 26B-A4B, 31B): Gemma's sandwich block with plain-gain RMSNorms,
q/k norms and a gainless value norm, full blocks with their own head width and kv heads (and values that are their
keys), proportional rotary on the full blocks, a stored scalar per block; E2B/E4B's per-layer inputs and kv-sharing
blocks, and 26B-A4B's experts beside the dense MLP. Each field is read as transformers 5's `Gemma4TextConfig` reads
it, and a value transformers' model could not run is refused by name."""

from __future__ import annotations

import re
from typing import Any

from ..config import GELU_ACTIVATIONS, ModelConfig
from ..config_checks import kv_sources
from . import writers
from .family import TINY_SHAPE, Family
from .fields import ConfigReader
from .layouts import GEMMA, Layout
from .presets import named_presets
from .readers import common_fields, read_head_dim, read_heads, read_kv_heads, sliding_windows, soft_cap
from .rope import gemma4_rope


def read(r: ConfigReader) -> dict[str, Any]:
    """Gemma 4's text model: Gemma's sandwich block with plain-gain RMSNorms, q/k norms and a gainless value norm,
    attention scores unscaled (the norms set their size), full blocks with their own head width and kv heads (and
    values that are their keys, `attention_k_eq_v`), proportional rotary on the full blocks, a stored scalar per block;
    per-layer inputs, kv sharing and experts beside the MLP where the config has them (`gemma4_extras`)."""
    r.require("use_bidirectional_attention", (None, "vision"), None)  # "vision" concerns image tokens only
    r.require("attn_logit_softcapping", (None,), None)  # not a Gemma 4 field; refused rather than ignored
    for key in ("rope_scaling", "rope_theta", "rope_local_base_freq", "partial_rotary_factor"):
        r.require(key, (None,), None)  # transformers 5 reads Gemma 4's rotary settings from rope_parameters only
    r.float("query_pre_attn_scalar", None, positive=True, null=None)  # typed only: transformers 5 does not read it
    act = r.require("hidden_activation", tuple(GELU_ACTIVATIONS), "gelu_pytorch_tanh")
    n_layers = r.n_layers("num_hidden_layers")
    d_model, n_heads = read_heads(r, "hidden_size", "num_attention_heads", must_divide=False)
    d_head = read_head_dim(r, d_model, n_heads, 256, null_derives=False)
    n_kv = read_kv_heads(r, n_heads, 4, null_derives=False)
    windows = sliding_windows(r, n_layers, 6, 512)
    types = windows["layer_types"][:-1] + ("full",)  # transformers 5 makes the last block full, whatever the config says
    k_is_v = r.bool("attention_k_eq_v", False)
    full_d_head, full_n_kv = _full_heads(r, types, d_head, n_kv, k_is_v)
    bias = r.bool("attention_bias", False)
    return {
        **common_fields(r, bos=2, eos=1),
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads, "d_head": d_head, "n_kv_heads": n_kv,
        "d_vocab": r.int("vocab_size"), "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("rms_norm_eps", 1e-6, positive=True), "norm": "rmsnorm", "mlp": "geglu", "activation": act,
        "norm_placement": "sandwich", "scale_embed": True, "tie_word_embeddings": r.bool("tie_word_embeddings", True),
        "fused_qkv": False, "qkv_bias": bias, "out_bias": bias, "mlp_bias": False, "query_pre_attn_scalar": 1.0,
        "qk_norm": True, "v_norm": True, "layer_scalar": True, "layer_types": types,
        "sliding_window": windows["sliding_window"] if "sliding" in types else None,
        "full_d_head": full_d_head, "full_n_kv_heads": full_n_kv, "full_k_is_v": k_is_v and "full" in types,
        "final_softcap": soft_cap(r, "final_logit_softcapping", None), **gemma4_rope(r, d_head),
        **_extras(r, n_layers, types),
    }


def _full_heads(r: ConfigReader, types: tuple[str, ...], d_head: int, n_kv: int,
                       k_is_v: bool) -> tuple[int | None, int | None]:
    """The full blocks' head width and kv heads, None where they are the sliding blocks': from `per_layer_config`
    (how transformers 5 writes them: layer index -> overrides, which must be the same for every full block and
    absent for the others), else `global_head_dim` (512 when absent) and `num_global_key_value_heads` (read only
    with attention_k_eq_v, as transformers reads it)."""
    per_layer = r.d.get("per_layer_config")
    full = [i for i, t in enumerate(types) if t == "full"]
    if per_layer is None:
        width = r.int("global_head_dim", 512)
        heads = r.int("num_global_key_value_heads", None)
        heads = heads if k_is_v else None
    else:
        if not isinstance(per_layer, dict):
            raise ValueError(f"config field per_layer_config={per_layer!r:.80} must be an object (model_type={r.family!r})")
        keys = {k: int(k) if isinstance(k, str) and k.isdigit() else k for k in per_layer}  # transformers writes "05"
        given = {keys[k]: v for k, v in per_layer.items()}
        firsts = [given.get(i) for i in full]
        first = firsts[0] if firsts else {}
        if (set(given) - set(full) or any(f != first for f in firsts) or not isinstance(first, dict)
                or set(first) - {"head_dim", "num_key_value_heads"}):
            raise ValueError(f"config field per_layer_config={per_layer!r:.120}: lenskit implements the same head_dim and "
                             f"num_key_value_heads overrides on every full_attention block ({full}) and none elsewhere "
                             f"(model_type={r.family!r})")
        sub = ConfigReader(first, r.family, where="per_layer_config.")
        width, heads = sub.int("head_dim", None), sub.int("num_key_value_heads", None)
    if not full:
        return None, None
    if heads is not None and r.d.get("num_attention_heads", 0) % heads:
        raise ValueError(f"config field num_global_key_value_heads={heads} must divide num_attention_heads="
                         f"{r.d.get('num_attention_heads')} (model_type={r.family!r}); fix config.json")
    return (None if width in (None, d_head) else width), (None if heads in (None, n_kv) else heads)


def _extras(r: ConfigReader, n_layers: int, types: tuple[str, ...]) -> dict[str, Any]:
    """E2B/E4B's and 26B-A4B's `ModelConfig` fields, from `hidden_size_per_layer_input` (0: none; transformers' default is 256) and
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
            "n_kv_shared_layers": shared, "double_wide_mlp": double and shared > 0, **_experts_beside(r)}


def _experts_beside(r: ConfigReader) -> dict[str, Any]:
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


def write(cfg: ModelConfig) -> dict[str, Any]:
    full = next((i for i in range(cfg.n_layers) if cfg.layer_type(i) == "full"), cfg.n_layers - 1)
    glob: dict[str, Any] = {"rope_type": cfg.rope.type, "rope_theta": cfg.rope.base}
    if cfg.rope.type == "proportional":
        glob.update(partial_rotary_factor=cfg.rope.proportion, factor=cfg.rope.factor)
    local = cfg.rope.base if cfg.rope.local_base is None else cfg.rope.local_base
    return {
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_mlp, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head,
        "global_head_dim": cfg.d_head_of(full), "num_global_key_value_heads": cfg.attention.full_n_kv_heads,
        "attention_k_eq_v": cfg.attention.full_k_is_v, "hidden_activation": cfg.activation, "max_position_embeddings": cfg.n_ctx,
        "rms_norm_eps": cfg.norm_eps, **writers.common_fields(cfg), "attention_bias": cfg.attention.qkv_bias,
        "sliding_window": cfg.sliding_window if cfg.sliding_window is not None else 512,
        "layer_types": writers.hf_layer_types(cfg),
        "final_logit_softcapping": cfg.final_softcap, "attention_dropout": 0.0,
        "hidden_size_per_layer_input": cfg.block.d_per_layer or 0,
        "vocab_size_per_layer_input": cfg.d_vocab if cfg.block.d_per_layer is None else cfg.block.d_vocab_per_layer,
        "num_kv_shared_layers": cfg.block.n_kv_shared_layers, "use_double_wide_mlp": cfg.block.double_wide_mlp,
        "enable_moe_block": cfg.block.experts_beside_mlp,
        **({"num_experts": cfg.moe.n_experts, "top_k_experts": cfg.moe.n_experts_per_token, "moe_intermediate_size": cfg.moe.d_expert}
           if cfg.block.experts_beside_mlp else {}),
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": local}, "full_attention": glob},
    }


_BLOCK = {
    **GEMMA.block, "layer_scalar": "layer_scalar",
    "attn.qkv.weight": "self_attn.q_proj.weight", "attn.qkv.bias": "self_attn.q_proj.bias",
    "per_layer.gate.weight": "per_layer_input_gate.weight", "per_layer.out.weight": "per_layer_projection.weight",
    "per_layer.ln_post.weight": "post_per_layer_input_norm.weight",
    "mlp.ln_dense_post.weight": "post_feedforward_layernorm_1.weight", "mlp.router.scale": "router.scale",
    "mlp.router.proj.weight": "router.proj.weight", "mlp.router.per_expert_scale": "router.per_expert_scale",
    "mlp.ln_experts.weight": "pre_feedforward_layernorm_2.weight", "mlp.experts.gate_up": "experts.gate_up_proj",
    "mlp.experts.down": "experts.down_proj", "mlp.ln_experts_post.weight": "post_feedforward_layernorm_2.weight",
}
_SHARED_KV = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def _unread(name: str, cfg) -> bool:
    """A kv-sharing block's k/v projection or norm: hub checkpoints store them, no forward reads them (transformers'
    `_keys_to_ignore_on_load_unexpected`)."""
    m = _SHARED_KV.match(name)
    return m is not None and int(m.group(1)) < cfg.n_layers and cfg.kv_source(int(m.group(1))) is not None


LAYOUT = Layout(
    prefix="model.", blocks="layers",
    top={**GEMMA.top, "per_layer_inputs.embed.weight": "embed_tokens_per_layer.weight",
         "per_layer_inputs.proj.weight": "per_layer_model_projection.weight",
         "per_layer_inputs.proj_norm.weight": "per_layer_projection_norm.weight"},
    block=_BLOCK, unread=_unread,
)


def _preset(name: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, full_n_kv_heads: int | None,
            d_mlp: int, window: int, n_ctx: int, pattern: int = 6, k_is_v: bool = True, **extra: Any) -> ModelConfig:
    """Gemma 4 (text): heads of 256 on the sliding blocks, of 512 on the full ones (one in `pattern`, and the last;
    with `k_is_v`, their own kv heads whose keys are the values), proportional rotary over a quarter of the full
    blocks' pairs (base 1e6), base 1e4 on the sliding ones, a final soft-cap of 30, a 262,144-token vocabulary;
    `extra`: per-layer inputs and kv sharing (E2B, E4B) or experts (26B-A4B). Shapes from the published config.json
    as recalled, not downloaded, checked against transformers' own models' totals (tests/test_gemma4_presets.py)."""
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=256, d_mlp=d_mlp,
        d_vocab=262144, n_ctx=n_ctx, norm="rmsnorm", norm_eps=1e-6, mlp="geglu", activation="gelu_pytorch_tanh",
        norm_placement="sandwich", scale_embed=True, tie_word_embeddings=True, family="gemma4_text", positional="rotary",
        rotary_base=1_000_000.0, local_rotary_base=10000.0, rope_type="proportional", rope_proportion=0.25,
        fused_qkv=False, qkv_bias=False, out_bias=False, query_pre_attn_scalar=1.0, qk_norm=True, v_norm=True,
        layer_scalar=True, sliding_window=window, full_d_head=512, full_n_kv_heads=full_n_kv_heads, full_k_is_v=k_is_v,
        layer_types=tuple("full" if (i + 1) % pattern == 0 or i == n_layers - 1 else "sliding" for i in range(n_layers)),
        final_softcap=30.0, bos_token_id=2, eos_token_id=1, name=name, **extra,
    )


# google/gemma-4-*'s text_config: E2B's 20 last blocks (E4B's 18) read earlier blocks' keys, and E2B's have
# MLPs twice as wide; 26B-A4B has 128 experts of 704 (8 per token) beside each dense MLP; E2B's full blocks are
# one in five, the others' one in six
PRESETS = named_presets(
    _preset("gemma-4-e2b", 35, 1536, 8, 1, None, 6144, 512, 131072, pattern=5, k_is_v=False, d_per_layer=256,
            n_kv_shared_layers=20, double_wide_mlp=True),
    _preset("gemma-4-e4b", 42, 2560, 8, 2, None, 10240, 512, 131072, k_is_v=False, d_per_layer=256,
            n_kv_shared_layers=18),
    _preset("gemma-4-26b-a4b", 30, 2816, 16, 8, 2, 2112, 1024, 262144, experts_beside_mlp=True, n_experts=128,
            n_experts_per_token=8, d_expert=704, routing="softmax_topk_renorm"),
    _preset("gemma-4-31b", 60, 5376, 32, 16, 4, 21504, 1024, 262144))

# Gemma 4: a sliding block (window shorter than the prompt, base 100) and a full one, whose heads are wider (24, not 16)
# with one kv head whose keys are also its values, proportional rotary over a quarter of its pairs; plain-gain norms
# (perturbed by conftest, which also moves each block's layer_scalar off 1), a final soft-cap that bites; E2B's
# per-layer inputs (of 8, vocabulary 300, the tiny tokenizer's), and with 3 blocks its kv sharing: the last block reads
# block 0's keys, its MLP twice as wide. 26B-A4B's experts: tests/test_gemma4_moe.py.
TINY = dict(TINY_SHAPE, num_key_value_heads=2, head_dim=16, global_head_dim=24, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=5, initializer_range=0.2, final_logit_softcapping=2.0,
            pad_token_id=0, hidden_size_per_layer_input=8, vocab_size_per_layer_input=300,
            use_double_wide_mlp=True, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                             "full_attention": dict(rope_type="proportional", partial_rotary_factor=0.25,
                                                    rope_theta=10000.0)})

# transformers makes the last block full, which here reads block 0's keys and values (the last earlier full block);
# block 1, the one most tests look into, keeps the sliding blocks' heads
FAMILY = Family("gemma4_text", "Gemma4ForCausalLM", "Gemma4TextConfig", "Gemma 4 (text only: E2B, E4B, 26B-A4B, 31B)",
                read, write, LAYOUT, PRESETS, TINY,
                tiny_3_blocks=dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "full_attention"],
                                   num_kv_shared_layers=1))

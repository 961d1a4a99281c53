"""Model configuration: a frozen dataclass of grouped settings (`lenskit.config_groups`), checked, and its conversion
from and to HF `config.json`.

The presets of published shapes live with their families in `lenskit.families`, which registers them here
(`register_families`); `PRESETS` is re-exported.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from .config_checks import (
    check_experts,
    check_full_heads,
    check_gemma4_extras,
    check_latent_attention,
    check_linear,
    check_llama4_attention,
    check_mamba,
    check_scales,
    kv_sources,
    shrunk_kv_sharing,
)
from .config_groups import (
    FLAT_NAMES,
    GROUPS,
    AttentionConfig,
    BlockConfig,
    LinearConfig,
    MambaConfig,
    MLAConfig,
    MoEConfig,
    RopeConfig,
    ScalesConfig,
)
from .config_names import TransformerLensNames
from .io.files import read_json_object
from .suggest import did_you_mean

# GPT-2's "gelu_new" and PyTorch's tanh GELU are the same function; "gelu" is the exact erf form.
GELU_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}
ROPE_TYPES = ("default", "llama3", "linear")  # what a rotary family reads unless it opts in to more
ROPE_TYPES_IMPLEMENTED = ROPE_TYPES + ("yarn", "proportional")  # yarn: gpt-oss; proportional: Gemma 4's full blocks

NORMS = ("layernorm", "rmsnorm", "rmsnorm_offset")  # rmsnorm_offset: gain (1 + weight), Gemma's
# geglu: gated, tanh GELU (Gemma); swiglu_fused: one gate_up (Phi-3); swiglu_clamped: gpt-oss's experts (biased,
# gate and up clamped at swiglu_limit, sigmoid gain swiglu_alpha), for mixture-of-experts blocks only
MLPS = ("gelu", "swiglu", "geglu", "swiglu_fused", "swiglu_clamped")
NORM_PLACEMENTS = ("pre", "sandwich", "post")  # before each sublayer; before and after (Gemma); after only (OLMo 2)
# linear: a Gated DeltaNet block (Qwen 3.5), lenskit.pieces.deltanet; chunked: a query sees the keys of its own chunk of
# `attention.chunk_size` positions only (Llama 4's rotary blocks); mamba: a Mamba-2 mixer, lenskit.pieces.mamba2;
# mlp: no token mixer at all, an MLP-only block (Nemotron-H's "-" layers, under block.one_sublayer)
LAYER_TYPES = ("full", "sliding", "linear", "chunked", "mamba", "mlp")
HEADED_LAYER_TYPES = ("full", "sliding", "chunked")  # the blocks whose token mixer has attention heads
# Router logits -> k expert weights (lenskit.pieces.moe): softmax over all experts then the top k (Qwen3-MoE and
# OLMoE without norm_topk_prob), the same renormalised to sum to 1 (Mixtral; norm_topk_prob), or the top k logits
# then a softmax over them (gpt-oss).
# DeepSeek V3: sigmoid scores, the top k chosen (within the best groups) by score plus a correction bias but weighted by
# the score alone, optionally renormalised (norm_topk_prob), then times routed_scaling_factor (lenskit.pieces.shared_experts).
# Llama 4: the top k logits, each weight the sigmoid of its logit, scaling the expert's input (lenskit.pieces.shared_experts).
ROUTINGS = ("softmax_topk", "softmax_topk_renorm", "topk_softmax", "sigmoid_group_topk", "sigmoid_group_topk_renorm",
            "sigmoid_topk")
POSITIONALS = ("learned", "rotary", "none")  # none: no positions at all, the Mamba-2 blocks order the tokens (Nemotron-H)
# The activation by the name transformers' configs give it: a GELU form, or ReLU (a plain MLP's only: GPT-2 and
# GPT-NeoX configs may name it, as TransformerLens's act_fn="relu" models do).
ACTIVATIONS = (*GELU_ACTIVATIONS, "relu", "relu2")  # relu2: ReLU squared (Nemotron-H's MLP)
LEARNED_ACTIVATIONS = ("xielu",)  # with parameters of their own, so only a family that stores them (Apertus) reads one
_INT_FIELDS = ("n_layers", "d_model", "n_heads", "d_vocab", "n_ctx", "d_mlp", "d_head", "n_kv_heads")
_BOOL_FIELDS = ("tie_word_embeddings", "parallel_block", "fused_qkv", "qkv_bias", "out_bias", "mlp_bias", "qk_norm",
                "qk_norm_per_head", "scale_embed", "attn_sinks", "rope_truncate", "router_bias", "attn_output_gate",
                "full_k_is_v", "v_norm", "layer_scalar", "double_wide_mlp", "experts_beside_mlp", "rope_interleave",
                "shared_expert_gate", "linear_fused", "rope_adjacent_pairs", "qk_unit_norm", "mamba_beside_attention",
                "mamba_conv_bias", "mamba_in_bias", "mamba_out_bias", "one_sublayer")
_POSITIVE_OR_NONE = ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "local_rotary_base",
                     "rope_attention_factor", "rope_mscale_all_dim")
_ORGANISATION = re.compile(r"[A-Za-z0-9][\w.-]*")  # a hub organisation: no path separators, no leading "." or "~"
_POSITIVE = ("rotary_base", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast",
             "rope_beta_slow", "swiglu_alpha", "swiglu_limit", "routed_scaling_factor", "embedding_multiplier",
             "residual_multiplier", "logits_multiplier")




_GROUPED = {group: {name: flat for flat, (g, name) in FLAT_NAMES.items() if g == group} for group in GROUPS}

# ------------------------------------------------------------------ the family registry
# lenskit.families imports this module to build its presets, so this module never imports it: the families register
# here instead (lenskit/__init__ imports lenskit.families, so the registry is full once `import lenskit` returns).
_REGISTRY: dict[str, Any] = {}


def register_families(*, presets: Mapping[str, "ModelConfig"], config_fields: Callable[..., dict[str, Any]],
                      family_of: Callable[[Any], Any]) -> None:
    """Called once by `lenskit.families`: its presets by short name, its config.json reader (HF dict -> ModelConfig
    keywords) and its record lookup by `model_type` (a record with `hf_class` and `hf_config(cfg)`)."""
    _REGISTRY.update(presets=presets, config_fields=config_fields, family_of=family_of)


def _registered(what: str) -> Any:
    if what not in _REGISTRY:
        raise RuntimeError(f"no model families are registered (looking up {what}); import lenskit, which imports "
                           "lenskit.families, before using ModelConfig's presets or config.json conversion")
    return _REGISTRY[what]


def _group_value(group: str, value: Any) -> Any:
    """A group given to ModelConfig: its dataclass, or a mapping of its names (what `dataclasses.asdict` gives)."""
    cls = GROUPS[group]
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(_GROUPED[group]))
        if unknown:
            raise TypeError(f"ModelConfig.{group} has no setting {unknown[0]!r}{did_you_mean(unknown[0], _GROUPED[group])}; "
                            f"its settings: {sorted(_GROUPED[group])}")
        return cls(**value)
    raise TypeError(f"ModelConfig.{group} must be a {cls.__name__} or a mapping of its settings, got {value!r}")


# Top-level fields that __init__ takes by position, in today's order (the first 19 of the flat signature).
_POSITIONAL = ("n_layers", "d_model", "n_heads", "d_vocab", "n_ctx", "d_mlp", "d_head", "norm_eps", "activation", "norm",
               "mlp", "tie_word_embeddings", "initializer_range", "bos_token_id", "eos_token_id", "name", "family",
               "n_kv_heads", "positional")


@dataclass(frozen=True, init=False)
class ModelConfig(TransformerLensNames):
    """Shape and numerics of a decoder-only transformer. Derived values live in `__post_init__` only.

    `family` is the Hugging Face `model_type` the weights come from; the other fields say which piece
    each part of the model is (see `lenskit.pieces.layers`), so nothing downstream branches on the family.

    The settings of one part of the model are grouped in frozen sub-configs: `cfg.rope` (RopeConfig),
    `cfg.attention` (AttentionConfig), `cfg.moe` (MoEConfig), `cfg.linear` (LinearConfig), `cfg.block`
    (BlockConfig), `cfg.mla` (MLAConfig), `cfg.mamba` (MambaConfig) and `cfg.scales` (ScalesConfig). `FLAT_NAMES` maps each one's flat keyword (`rope_factor`, `attn_softcap`, `linear_d_k`, ...) to its
    place (`cfg.rope.factor`); `ModelConfig(...)`, `replace(...)` and `dataclasses.replace` take the flat keywords and
    the groups alike (a flat keyword wins over its group's value). A flat name also reads, as a read-only alias
    resolved in one place (`__getattr__`), so code written before the groups keeps running; lenskit's own code reads
    through the groups. `to_flat_dict()` gives every setting by its flat name.

    >>> ModelConfig.from_name("gpt2").d_head
    64
    >>> ModelConfig.from_name("llama-3.2-1b").rope.factor
    32.0
    """

    n_layers: int
    d_model: int
    n_heads: int
    d_vocab: int
    n_ctx: int
    d_mlp: int | None = None  # None means 4 * d_model, as in GPT-2
    d_head: int | None = None  # None means d_model // n_heads
    norm_eps: float = 1e-5
    activation: str = "gelu_new"
    norm: str = "layernorm"
    mlp: str = "gelu"
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "custom"
    family: str = "gpt2"
    n_kv_heads: int | None = None  # None means n_heads (no grouped-query attention)
    positional: str = "learned"  # "learned": a pos_embed table added to the stream; "rotary": q and k are rotated
    sliding_window: int | None = None  # a query sees itself and the sliding_window - 1 keys before it
    parallel_block: bool = False  # attention and MLP both read resid_pre (GPT-NeoX)
    mlp_bias: bool | None = None  # None means True for the GELU MLP, False for SwiGLU
    norm_placement: str = "pre"  # see NORM_PLACEMENTS; "sandwich" and "post" add ln1_post / ln2_post
    scale_embed: bool = False  # the embedding is multiplied by sqrt(d_model), in the model's dtype (Gemma)
    final_softcap: float | None = None  # logits -> c * tanh(logits / c) at the end of the readout (Gemma 2)
    layer_types: tuple[str, ...] | None = None  # per block, one of LAYER_TYPES; None: every block uses sliding_window
    nope_layers: tuple[int, ...] = ()  # blocks whose attention has no rotary embedding at all ("NoPE", SmolLM3)
    rope: RopeConfig = RopeConfig()
    attention: AttentionConfig = AttentionConfig()
    moe: MoEConfig = MoEConfig()
    linear: LinearConfig = LinearConfig()
    block: BlockConfig = BlockConfig()
    mla: MLAConfig = MLAConfig()
    scales: ScalesConfig = ScalesConfig()
    mamba: MambaConfig = MambaConfig()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Take today's flat keywords (`rope_factor=8.0`), the groups (`rope=RopeConfig(...)` or a mapping), or both."""
        if len(args) > len(_POSITIONAL):
            raise TypeError(f"ModelConfig takes at most {len(_POSITIONAL)} positional arguments ({', '.join(_POSITIONAL)}), "
                            f"got {len(args)}; pass the others by keyword")
        for key, value in zip(_POSITIONAL, args):
            if key in kwargs:
                raise TypeError(f"ModelConfig got multiple values for argument {key!r}")
            kwargs[key] = value
        top = {f.name: f for f in dataclasses.fields(ModelConfig)}
        unknown = [k for k in kwargs if k not in top and k not in FLAT_NAMES]
        if unknown:
            raise TypeError(f"ModelConfig got an unexpected keyword argument {unknown[0]!r}"
                            f"{did_you_mean(unknown[0], [*top, *FLAT_NAMES])}")
        missing = [k for k in _POSITIONAL[:5] if k not in kwargs]
        if missing:
            raise TypeError(f"ModelConfig is missing required argument(s): {', '.join(missing)}")
        for key, f in top.items():
            if key in GROUPS:
                group = _group_value(key, kwargs.get(key, f.default))
                flat = {name: kwargs[flat] for name, flat in _GROUPED[key].items() if flat in kwargs}
                object.__setattr__(self, key, dataclasses.replace(group, **flat) if flat else group)
            else:
                object.__setattr__(self, key, kwargs.get(key, f.default))
        self.__post_init__()

    if not TYPE_CHECKING:  # a type checker sees no alias: it flags a flat read, and a misspelt name stays an error
        def __getattr__(self, name: str) -> Any:
            """A grouped setting by its flat name (`cfg.rope_factor` is `cfg.rope.factor`): the read-only alias that
            keeps code written before the groups running. Only called where ordinary lookup fails."""
            group, key = FLAT_NAMES.get(name, (None, None))
            if group not in self.__dict__:  # not a flat name (or, while unpickling, no groups yet)
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            return getattr(self.__dict__[group], key)

    def to_flat_dict(self) -> dict[str, Any]:
        """Every setting by its flat name (the top-level fields, then each group's as `FLAT_NAMES` spells them):
        `ModelConfig(**d)` is this config again, as `ModelConfig(**dataclasses.asdict(cfg))` is (groups nested)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in GROUPS}
        for flat, (group, name) in FLAT_NAMES.items():
            d[flat] = getattr(getattr(self, group), name)
        return d

    def _set(self, group: str | None, name: str, value: Any) -> None:
        """Set one derived value during construction (the config is frozen afterwards)."""
        if group is None:
            object.__setattr__(self, name, value)
        else:
            object.__setattr__(self, group, dataclasses.replace(getattr(self, group), **{name: value}))

    def __post_init__(self) -> None:
        # Derived values, all of them here: each None that means "as another field says" takes that value.
        if self.d_mlp is None:
            self._set(None, "d_mlp", 4 * self.d_model)
        if self.d_head is None:
            if not isinstance(self.n_heads, int) or isinstance(self.n_heads, bool) or self.n_heads <= 0:
                raise ValueError(f"ModelConfig.n_heads must be a positive int, got {self.n_heads!r}")
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "pass d_head explicitly or choose a divisor"
                )
            self._set(None, "d_head", self.d_model // self.n_heads)
        if self.n_kv_heads is None:
            self._set(None, "n_kv_heads", self.n_heads)
        if self.mlp_bias is None:
            self._set(None, "mlp_bias", self.mlp == "gelu")
        if self.layer_types is not None:
            self._set(None, "layer_types", tuple(self.layer_types))
        self._set(None, "nope_layers", tuple(self.nope_layers))
        if isinstance(self.mamba.multipliers, list):  # as config.json and asdict give it
            self._set("mamba", "multipliers", tuple(self.mamba.multipliers))
        if self.rope.dim is None and self.positional == "rotary":
            self._set("rope", "dim", self.d_head)
        if self.moe.n_experts is not None:
            if self.moe.d_expert is None:
                self._set("moe", "d_expert", self.d_mlp)
            self._set("moe", "dense_layers", tuple(self.moe.dense_layers))
        if self.attention.full_d_head == self.d_head:  # one way to say "the full blocks' heads are the others'": None
            self._set("attention", "full_d_head", None)
        if self.attention.full_n_kv_heads == self.n_kv_heads:
            self._set("attention", "full_n_kv_heads", None)
        if self.block.d_per_layer is not None and self.block.d_vocab_per_layer is None:
            self._set("block", "d_vocab_per_layer", self.d_vocab)
        self._check()

    def _check(self) -> None:
        """Refuse a bad value, naming it as the user typed it (`ModelConfig.rope_factor must be ...`)."""
        flat = self.to_flat_dict()
        for field in _INT_FIELDS:
            value = flat[field]
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        for field in _BOOL_FIELDS:
            if not isinstance(flat[field], bool):
                raise ValueError(f"ModelConfig.{field} must be True or False, got {flat[field]!r}")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not self.norm_eps > 0:
            raise ValueError(f"ModelConfig.norm_eps must be a positive number, got {self.norm_eps!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.activation not in ACTIVATIONS + LEARNED_ACTIVATIONS:
            raise ValueError(
                f"ModelConfig.activation={self.activation!r} is not an activation lenskit builds; "
                f"supported: {sorted(ACTIVATIONS + LEARNED_ACTIVATIONS)}"
            )
        if self.activation not in GELU_ACTIVATIONS and self.mlp != "gelu":
            raise ValueError(f"ModelConfig.activation={self.activation!r} is for the plain MLP (mlp='gelu'), got "
                             f"mlp={self.mlp!r}; a gated MLP takes a GELU form ({', '.join(GELU_ACTIVATIONS)})")
        for field in _POSITIVE_OR_NONE:
            value = flat[field]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf")):
                raise ValueError(f"ModelConfig.{field} must be None or a positive number, got {value!r}")
        if self.layer_types is not None and (len(self.layer_types) != self.n_layers
                                             or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"ModelConfig.layer_types must name one of {LAYER_TYPES} for each of the {self.n_layers} blocks, "
                             f"got {self.layer_types!r}")
        if self.layer_types is not None and "mlp" in self.layer_types and not self.block.one_sublayer:
            raise ValueError("ModelConfig.layer_types has 'mlp' blocks (no token mixer), which only one_sublayer=True "
                             "builds; set one_sublayer or give each block a mixer")
        if self.layer_types is not None and "sliding" in self.layer_types and self.sliding_window is None:
            raise ValueError("ModelConfig.layer_types has 'sliding' blocks but sliding_window is None; give the window")
        check_llama4_attention(self)
        choices = [("norm", NORMS), ("mlp", MLPS), ("positional", POSITIONALS), ("rope_type", ROPE_TYPES_IMPLEMENTED),
                   ("norm_placement", NORM_PLACEMENTS)]
        if self.moe.n_experts is not None:  # a dense model never routes
            choices.append(("routing", ROUTINGS))
        for field, allowed in choices:
            if flat[field] not in allowed:
                raise ValueError(f"ModelConfig.{field}={flat[field]!r}; supported: {allowed}")
        rope = self.rope
        # latent attention's rotated features are their own part of each head, beside the d_head-wide value
        widest = float("inf") if self.mla.kv_lora_rank is not None else self.d_head
        if self.positional == "rotary" and not (isinstance(rope.dim, int) and 0 < rope.dim <= widest
                                                and rope.dim % 2 == 0):
            bound = f"(0, d_head={self.d_head}]" if widest == self.d_head else "above 0 (latent attention's rotated part)"
            raise ValueError(f"ModelConfig.rotary_dim={rope.dim!r} must be an even int {bound}")
        for flat_name, (group, _) in FLAT_NAMES.items():
            value = flat[flat_name]
            if group == "scales" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise ValueError(f"ModelConfig.{flat_name} must be a finite number, got {value!r}")
        for field in _POSITIVE:  # transformers computes NaN or inf frequencies from a base or factor <= 0
            value = flat[field]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"ModelConfig.{field} must be a positive finite number, got {value!r}")
        if rope.type in ("llama3", "yarn") and (not isinstance(rope.original_n_ctx, int)
                                                 or isinstance(rope.original_n_ctx, bool) or rope.original_n_ctx <= 0):
            raise ValueError(f"ModelConfig.rope_original_n_ctx must be a positive int for rope_type={rope.type!r}, "
                             f"got {rope.original_n_ctx!r}")
        if rope.type == "yarn" and rope.beta_fast < rope.beta_slow:
            raise ValueError(f"ModelConfig.rope_beta_fast={rope.beta_fast!r} must be >= rope_beta_slow="
                             f"{rope.beta_slow!r}: the ramp runs from the fast dims to the slow ones")
        if rope.type != "yarn" and rope.attention_factor is not None:
            raise ValueError(f"ModelConfig.rope_attention_factor={rope.attention_factor!r} is a yarn setting; "
                             f"rope_type={rope.type!r} does not scale cos and sin, so leave it None")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool)
                                                or self.sliding_window <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be None or a positive int, got {self.sliding_window!r}")
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers for i in self.nope_layers) \
                or list(self.nope_layers) != sorted(set(self.nope_layers)):
            raise ValueError(f"ModelConfig.nope_layers={self.nope_layers!r} must be increasing block indices in "
                             f"[0, {self.n_layers})")
        if self.nope_layers and self.positional != "rotary":
            raise ValueError(f"ModelConfig.nope_layers={self.nope_layers!r} names blocks without rotary, but positional="
                             f"{self.positional!r}; leave nope_layers empty")
        if rope.type == "default" and rope.mscale_all_dim is not None:
            raise ValueError(f"ModelConfig.rope_mscale_all_dim={rope.mscale_all_dim!r} scales latent attention's scores "
                             "only under a rescaled rotary (transformers ignores it for rope_type='default'); leave it None")
        check_experts(self)
        check_latent_attention(self)
        check_linear(self)
        check_scales(self)
        check_mamba(self)
        check_full_heads(self)
        check_gemma4_extras(self)

    @property
    def gelu_approximate(self) -> str:
        """The `approximate` argument of `torch.nn.functional.gelu` for this activation (a GELU form)."""
        return GELU_ACTIVATIONS[self.activation]

    def layer_type(self, layer: int) -> str:
        """"full" or "sliding" for block `layer`."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "full" if self.sliding_window is None else "sliding"

    def has_heads(self, layer: int) -> bool:
        """Whether block `layer`'s token mixer is softmax attention with heads (not linear attention, a Mamba-2
        mixer, or no mixer at all)."""
        return self.layer_type(layer) in HEADED_LAYER_TYPES

    def has_mlp(self, layer: int) -> bool:
        """Whether block `layer` has an MLP: all but a one-sublayer model's mixer-only blocks (Nemotron-H)."""
        return not self.block.one_sublayer or self.layer_type(layer) == "mlp"

    def rotates(self, layer: int) -> bool:
        """Whether block `layer`'s attention rotates q and k (rotary positions, and not one of `nope_layers`)."""
        return self.positional == "rotary" and layer not in self.nope_layers

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer`'s MLP is a mixture of experts (lenskit.pieces.moe) rather than the dense MLP, or
        has experts beside its dense MLP (`block.experts_beside_mlp`, lenskit.pieces.dense_and_experts)."""
        return self.moe.n_experts is not None and layer not in self.moe.dense_layers

    def kv_source(self, layer: int) -> int | None:
        """The block whose keys and values block `layer` reads, or None where it computes its own: each of the last
        `block.n_kv_shared_layers` blocks reads the last block before them of its own layer type (Gemma 4 E2B, E4B)."""
        if layer < self.n_layers - self.block.n_kv_shared_layers:
            return None
        return kv_sources(self.n_layers, self.block.n_kv_shared_layers, self.layer_types)[layer]

    @property
    def kv_source_layers(self) -> tuple[int | None, ...]:
        """`kv_source` of every block: `cfg.kv_source_layers[L]` is the block whose keys block L reads, or None."""
        return tuple(self.kv_source(i) for i in range(self.n_layers))

    def d_mlp_of(self, layer: int) -> int:
        """Block `layer`'s dense MLP width: 2 * d_mlp for a kv-sharing block under `double_wide_mlp`, else d_mlp."""
        return 2 * self.d_mlp if self.block.double_wide_mlp and self.kv_source(layer) is not None else self.d_mlp

    def d_head_of(self, layer: int) -> int:
        """Block `layer`'s head width: `attention.full_d_head` for a "full" block where it is set, else d_head."""
        full_d_head = self.attention.full_d_head
        return full_d_head if full_d_head is not None and self.layer_type(layer) == "full" else self.d_head

    def n_kv_heads_of(self, layer: int) -> int:
        """Block `layer`'s key/value heads: `attention.full_n_kv_heads` for a "full" block where set, else n_kv_heads."""
        full = self.attention.full_n_kv_heads is not None and self.layer_type(layer) == "full"
        return self.attention.full_n_kv_heads if full else self.n_kv_heads

    def k_is_v(self, layer: int) -> bool:
        """Whether block `layer`'s values are its keys' projection (a "full" block under `attention.full_k_is_v`)."""
        return self.attention.full_k_is_v and self.layer_type(layer) == "full"

    @property
    def is_gpt2(self) -> bool:
        """True when the architecture is exactly GPT-2's, so it can be saved in the HF layout."""
        return (self.family == "gpt2" and self.norm == "layernorm" and self.mlp == "gelu" and self.positional == "learned"
                and self.d_head * self.n_heads == self.d_model and self.n_kv_heads == self.n_heads)

    @property
    def original_architecture(self) -> str:
        """The transformers class of the family, e.g. "LlamaForCausalLM" (TransformerLens's name; the others are in
        `lenskit.config_names`, this one here because it reads the family registry)."""
        return _registered("family_of")(self.family).hf_class

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed, by flat name (`rope_factor=8.0`) or by group (`rope=RopeConfig(...)`, every
        setting of the group given). A field derived from others follows them, unless it is given too:

        - d_head: d_model // n_heads when either changes (also where the preset's heads are wider, Qwen 3, Gemma);
        - n_kv_heads: keeps the group of query heads per kv head (MHA stays MHA); raises if the new n_heads
          is not a multiple of it;
        - d_mlp: keeps the MLP's width ratio d_mlp / d_model (rounded): 4 for GPT-2, 3.5 for Llama 3.1 8B;
        - rotary_dim: keeps its fraction of d_head (Pythia's quarter, Phi-3's whole), rounded down to even;
        - query_pre_attn_scalar: keeps its ratio to d_head (Gemma's scores are scaled by d_head ** -0.5), except 1
          (Gemma 4's unscaled scores, whose q/k norms set their size), which stays 1;
        - full_d_head and full_n_kv_heads (Gemma 4's full blocks): keep their ratio to d_head and their group;
        - mlp_bias: when mlp changes, the new MLP's default, unless the old value differed from the old default;
        - layer_types: its repeating pattern continues over the new n_layers (Gemma 3's five local, one global).
        - nope_layers: its repeating pattern continues too (SmolLM3's every fourth block without rotary);
        - n_kv_shared_layers (Gemma 4): keeps its share of the blocks where every sharing block still has a source
          (fewer where not), and double_wide_mlp goes when none is left; d_vocab_per_layer follows d_vocab if equal;

        >>> small = ModelConfig.from_name("pythia-70m").replace(n_layers=2, d_model=64, n_heads=4)
        >>> small.d_head, small.rope.dim, small.d_mlp
        (16, 4, 256)
        """
        def usable(value: Any) -> bool:  # derive only from positive ints; __post_init__ refuses anything else
            return isinstance(value, int) and not isinstance(value, bool) and value > 0

        def given(name: str) -> bool:
            return name in changes and usable(changes[name])

        changes = dict(changes)
        for group in GROUPS:  # a whole group given: each of its settings given by its flat name
            if group in changes:
                value = _group_value(group, changes.pop(group))
                changes = {**{flat: getattr(value, name) for name, flat in _GROUPED[group].items()}, **changes}
        fields = self.to_flat_dict()
        old = dict(fields)  # this config's values, by flat name
        d_head = changes.get("d_head", self.d_head)
        if ("d_model" in changes or "n_heads" in changes) and "d_head" not in changes:
            fields["d_head"] = None  # __post_init__: d_model // n_heads, or the error saying why not
            d_model, n_heads = changes.get("d_model", self.d_model), changes.get("n_heads", self.n_heads)
            d_head = d_model // n_heads if usable(d_model) and usable(n_heads) and d_model % n_heads == 0 else None
        if given("n_heads") and "n_kv_heads" not in changes:
            group = self.n_heads // self.n_kv_heads
            if changes["n_heads"] % group:
                raise ValueError(
                    f"{self.name} has {group} query heads per kv head ({self.n_heads} heads, {self.n_kv_heads} kv heads) "
                    f"and n_heads={changes['n_heads']} is not a multiple of {group}; pass n_kv_heads as well"
                )
            fields["n_kv_heads"] = changes["n_heads"] // group
            if old["full_n_kv_heads"] is not None and "full_n_kv_heads" not in changes:  # Gemma 4's full blocks' group too
                fields["full_n_kv_heads"] = max(1, changes["n_heads"] // (self.n_heads // old["full_n_kv_heads"]))
        if given("d_model") and "d_mlp" not in changes:
            fields["d_mlp"] = max(1, round(changes["d_model"] * self.d_mlp / self.d_model))
        if usable(d_head) and d_head != self.d_head:
            if "rotary_dim" not in changes and old["rotary_dim"] is not None:
                fields["rotary_dim"] = max(2, d_head * old["rotary_dim"] // self.d_head // 2 * 2)
            if "query_pre_attn_scalar" not in changes and old["query_pre_attn_scalar"] not in (None, 1.0):
                fields["query_pre_attn_scalar"] = old["query_pre_attn_scalar"] * d_head / self.d_head
            if "full_d_head" not in changes and old["full_d_head"] is not None:  # Gemma 4's wider full heads, in ratio
                fields["full_d_head"] = max(2, d_head * old["full_d_head"] // self.d_head // 2 * 2)
        if "mlp" in changes and "mlp_bias" not in changes and self.mlp_bias == (self.mlp == "gelu"):
            fields["mlp_bias"] = None  # __post_init__: the new MLP's default
        if given("n_layers") and "layer_types" not in changes and self.layer_types is not None:
            types = self.layer_types  # its shortest period repeats: blocks keep their types, new ones continue it
            period = next(p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types)))
            fields["layer_types"] = tuple(types[i % period] for i in range(changes["n_layers"]))
        if given("n_layers") and "dense_layers" not in changes:  # dense blocks past the new depth are gone
            fields["dense_layers"] = tuple(i for i in old["dense_layers"] if i < changes["n_layers"])
        if given("n_layers") and "nope_layers" not in changes and self.nope_layers:  # as layer_types: the pattern goes on
            flags = [i in self.nope_layers for i in range(self.n_layers)]
            period = next(p for p in range(1, len(flags) + 1) if all(f == flags[i % p] for i, f in enumerate(flags)))
            fields["nope_layers"] = tuple(i for i in range(changes["n_layers"]) if flags[i % period])
        if given("d_vocab") and "d_vocab_per_layer" not in changes and old["d_vocab_per_layer"] == self.d_vocab:
            fields["d_vocab_per_layer"] = None  # __post_init__: d_vocab again (Gemma 4's per-layer inputs)
        if given("n_layers") and "n_kv_shared_layers" not in changes and old["n_kv_shared_layers"]:  # Gemma 4's share
            fields.update(shrunk_kv_sharing(self, changes["n_layers"], changes.get("layer_types", fields["layer_types"])))
        fields.update(changes)
        return ModelConfig(**fields)

    # ------------------------------------------------------------------ presets
    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        """A preset by name (see `PRESETS`); an organisation prefix such as `openai-community/` is fine. A path
        (`../../gpt2`, `./gpt2`, `a/b/gpt2`) is not a preset's name, whatever it ends in."""
        presets = _registered("presets")
        org, slash, key = str(name).rpartition("/")
        if key.lower() not in presets or (slash and not _ORGANISATION.fullmatch(org)):
            raise KeyError(f"no preset named {name!r}{did_you_mean(key.lower(), presets)}; presets (a short name, optionally after an organisation "
                           f"such as openai-community/): {sorted(presets)}")
        return presets[key.lower()]

    # ------------------------------------------------------------ HF conversion
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any] | Any, name: str = "custom",
                       tensor_names: Iterable[str] | None = None) -> "ModelConfig":
        """Build from a Hugging Face config (a `PretrainedConfig` or the dict of `config.json`); the
        family comes from `model_type`. A field whose behaviour lenskit does not implement raises,
        naming the field, rather than being silently ignored; an absent field takes transformers' default.
        `tensor_names`, the checkpoint's, if known: a layer count above the blocks they hold is refused before
        anything that scales with it is built."""
        d = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
        return cls(**_registered("config_fields")(d, tensor_names), name=name)

    @classmethod
    def from_json(cls, path: str | os.PathLike, name: str = "custom",
                  tensor_names: Iterable[str] | None = None) -> "ModelConfig":
        """Read a Hugging Face `config.json` (`tensor_names`: see `from_hf_config`)."""
        data = read_json_object(path, what="a Hugging Face config.json (a JSON object)")  # bounded, FIFO-safe
        return cls.from_hf_config(data, name=name, tensor_names=tensor_names)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` that transformers' class for this family (`Family.hf_class`) and lenskit both read as
        this config; one the family cannot express is refused, naming the fields."""
        return _registered("family_of")(self.family).hf_config(self)


def _flat_signature() -> inspect.Signature:
    """ModelConfig(...)'s signature as help() and editors show it: the top-level fields, then every flat keyword."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(ModelConfig):
        kind = P.POSITIONAL_OR_KEYWORD if f.name in _POSITIONAL else P.KEYWORD_ONLY
        default = P.empty if f.default is dataclasses.MISSING else f.default
        params.append(P(f.name, kind, default=default, annotation=f.type))
    for flat, (group, name) in FLAT_NAMES.items():
        group_field = next(g for g in dataclasses.fields(GROUPS[group]) if g.name == name)
        params.append(P(flat, P.KEYWORD_ONLY, default=group_field.default, annotation=group_field.type))
    return inspect.Signature(params)


ModelConfig.__init__.__signature__ = _flat_signature()  # type: ignore[attr-defined]


def __getattr__(name: str) -> Any:
    """`PRESETS`, as `lenskit.families` registered them (families builds them from ModelConfig, so it imports this module)."""
    if name == "PRESETS":
        return _registered("presets")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

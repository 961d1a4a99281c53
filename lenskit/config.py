"""Model configuration: a frozen dataclass, presets of published shapes, and conversion from HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .families import GELU_ACTIVATIONS, ROPE_TYPES, config_fields

NORMS = ("layernorm", "rmsnorm", "rmsnorm_offset")  # rmsnorm_offset: gain (1 + weight), Gemma's
MLPS = ("gelu", "swiglu", "geglu", "swiglu_fused")  # geglu: gated, tanh GELU (Gemma); swiglu_fused: one gate_up (Phi-3)
NORM_PLACEMENTS = ("pre", "sandwich", "post")  # before each sublayer; before and after (Gemma); after only (OLMo 2)
LAYER_TYPES = ("full", "sliding")
POSITIONALS = ("learned", "rotary")
ACTIVATIONS = GELU_ACTIVATIONS
_INT_FIELDS = ("n_layers", "d_model", "n_heads", "d_vocab", "n_ctx", "d_mlp", "d_head", "n_kv_heads")
_BOOL_FIELDS = ("tie_word_embeddings", "parallel_block", "fused_qkv", "qkv_bias", "out_bias", "mlp_bias", "qk_norm",
                "qk_norm_per_head", "scale_embed")
_POSITIVE_OR_NONE = ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "local_rotary_base")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer. Derived values live in `__post_init__` only.

    `family` is the Hugging Face `model_type` the weights come from; the other fields say which piece
    each part of the model is (see `lenskit.layers`), so nothing downstream branches on the family.

    >>> ModelConfig.from_name("gpt2").d_head
    64
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
    rotary_dim: int | None = None  # None means d_head when positional == "rotary"; fewer dims is partial rotary
    rotary_base: float = 10000.0
    rope_type: str = "default"  # or "llama3": frequencies rescaled by the four fields below
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_n_ctx: int | None = None
    sliding_window: int | None = None  # a query sees itself and the sliding_window - 1 keys before it
    parallel_block: bool = False  # attention and MLP both read resid_pre (GPT-NeoX)
    fused_qkv: bool = True  # one projection `attn.qkv` (GPT-2, NeoX) or three, `attn.qkv.q/k/v`
    qkv_bias: bool = True
    out_bias: bool = True
    mlp_bias: bool | None = None  # None means True for the GELU MLP, False for SwiGLU
    qk_norm: bool = False  # an RMSNorm over d_head on each query and key head (Qwen 3)
    qk_norm_per_head: bool = True  # False: the q/k norm spans all heads' features at once (OLMo 2)
    norm_placement: str = "pre"  # see NORM_PLACEMENTS; "sandwich" and "post" add ln1_post / ln2_post
    scale_embed: bool = False  # the embedding is multiplied by sqrt(d_model), in the model's dtype (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scores are scaled by this ** -0.5 (None: d_head ** -0.5)
    attn_softcap: float | None = None  # scores -> c * tanh(scores / c) before the mask (Gemma 2)
    final_softcap: float | None = None  # logits -> c * tanh(logits / c) at the end of the readout (Gemma 2)
    layer_types: tuple[str, ...] | None = None  # per block, "full" or "sliding"; None: every block uses sliding_window
    local_rotary_base: float | None = None  # rotary base of the "sliding" blocks when it differs (Gemma 3)

    def __post_init__(self) -> None:
        if self.d_mlp is None:
            object.__setattr__(self, "d_mlp", 4 * self.d_model)
        if self.d_head is None:
            if not isinstance(self.n_heads, int) or isinstance(self.n_heads, bool) or self.n_heads <= 0:
                raise ValueError(f"ModelConfig.n_heads must be a positive int, got {self.n_heads!r}")
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "pass d_head explicitly or choose a divisor"
                )
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.mlp_bias is None:
            object.__setattr__(self, "mlp_bias", self.mlp == "gelu")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.rotary_dim is None and self.positional == "rotary":
            object.__setattr__(self, "rotary_dim", self.d_head)
        for field in _INT_FIELDS:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        for field in _BOOL_FIELDS:
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"ModelConfig.{field} must be True or False, got {getattr(self, field)!r}")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not self.norm_eps > 0:
            raise ValueError(f"ModelConfig.norm_eps must be a positive number, got {self.norm_eps!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"ModelConfig.activation={self.activation!r} is not a GELU activation; "
                f"supported: {sorted(ACTIVATIONS)}"
            )
        for field in _POSITIVE_OR_NONE:
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf")):
                raise ValueError(f"ModelConfig.{field} must be None or a positive number, got {value!r}")
        if self.layer_types is not None and (len(self.layer_types) != self.n_layers
                                             or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"ModelConfig.layer_types must name one of {LAYER_TYPES} for each of the {self.n_layers} blocks, "
                             f"got {self.layer_types!r}")
        if self.layer_types is not None and "sliding" in self.layer_types and self.sliding_window is None:
            raise ValueError("ModelConfig.layer_types has 'sliding' blocks but sliding_window is None; give the window")
        for field, allowed in (("norm", NORMS), ("mlp", MLPS), ("positional", POSITIONALS), ("rope_type", ROPE_TYPES),
                               ("norm_placement", NORM_PLACEMENTS)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}; supported: {allowed}")
        if self.positional == "rotary" and not (isinstance(self.rotary_dim, int) and 0 < self.rotary_dim <= self.d_head
                                                and self.rotary_dim % 2 == 0):
            raise ValueError(f"ModelConfig.rotary_dim={self.rotary_dim!r} must be an even int in (0, d_head={self.d_head}]")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool)
                                                or self.sliding_window <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be None or a positive int, got {self.sliding_window!r}")

    @property
    def gelu_approximate(self) -> str:
        """The `approximate` argument of `torch.nn.functional.gelu` for this activation."""
        return ACTIVATIONS[self.activation]

    def layer_type(self, layer: int) -> str:
        """"full" or "sliding" for block `layer`."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "full" if self.sliding_window is None else "sliding"

    @property
    def is_gpt2(self) -> bool:
        """True when the architecture is exactly GPT-2's, so it can be saved in the HF layout."""
        return (self.family == "gpt2" and self.norm == "layernorm" and self.mlp == "gelu" and self.positional == "learned"
                and self.d_head * self.n_heads == self.d_model and self.n_kv_heads == self.n_heads)

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed; derived fields follow unless given explicitly."""
        fields = dataclasses.asdict(self)
        if ("d_model" in changes or "n_heads" in changes) and "d_head" not in changes:
            fields["d_head"] = None
        if "n_heads" in changes and "n_kv_heads" not in changes and self.n_kv_heads == self.n_heads:
            fields["n_kv_heads"] = None
        if "d_model" in changes and "d_mlp" not in changes:
            fields["d_mlp"] = None
        if "n_layers" in changes and "layer_types" not in changes and self.layer_types is not None:
            cycle = self.layer_types  # the pattern repeats: blocks 0..n-1 keep their types, new ones continue it
            fields["layer_types"] = tuple(cycle[i % len(cycle)] for i in range(changes["n_layers"]))
        fields.update(changes)
        return ModelConfig(**fields)

    # ------------------------------------------------------------------ presets
    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        """A preset by name (see `PRESETS`); an organisation prefix such as `openai-community/` is fine."""
        key = name.split("/")[-1].lower()
        if key not in PRESETS:
            raise KeyError(f"no preset named {name!r}; presets: {sorted(PRESETS)}")
        return PRESETS[key]

    # ------------------------------------------------------------ HF conversion
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any] | Any, name: str = "custom") -> "ModelConfig":
        """Build from a Hugging Face config (a `PretrainedConfig` or the dict of `config.json`); the
        family comes from `model_type`. A field whose behaviour lenskit does not implement raises,
        naming the field, rather than being silently ignored."""
        d = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
        return cls(**config_fields(d), name=name)

    @classmethod
    def from_json(cls, path: str | os.PathLike, name: str = "custom") -> "ModelConfig":
        """Read a Hugging Face `config.json`."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); expected a Hugging Face config.json") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds a {type(data).__name__}, expected a JSON object")
        return cls.from_hf_config(data, name=name)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` that `transformers.GPT2LMHeadModel` reads for this architecture."""
        if not self.is_gpt2:
            raise ValueError(
                f"family={self.family!r}, norm={self.norm!r}, mlp={self.mlp!r}: saving in the Hugging Face layout is "
                "implemented for the plain GPT-2 architecture only; keep the checkpoint folder you loaded from"
            )
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_layer": self.n_layers,
            "n_embd": self.d_model,
            "n_head": self.n_heads,
            "n_inner": self.d_mlp,
            "vocab_size": self.d_vocab,
            "n_positions": self.n_ctx,
            "layer_norm_epsilon": self.norm_eps,
            "activation_function": self.activation,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "use_cache": True,
        }


def _gpt2(name: str, n_layers: int, d_model: int, n_heads: int) -> ModelConfig:
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_vocab=50257, n_ctx=1024,
        bos_token_id=50256, eos_token_id=50256, name=name,
    )


def _pythia(name: str, n_layers: int, d_model: int, n_heads: int, d_vocab: int = 50304) -> ModelConfig:
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_vocab=d_vocab, n_ctx=2048, activation="gelu",
        tie_word_embeddings=False, family="gpt_neox", positional="rotary", rotary_dim=d_model // n_heads // 4,
        parallel_block=True, bos_token_id=0, eos_token_id=0, name=name,
    )


def _llama(name: str, family: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_mlp: int, d_vocab: int,
           n_ctx: int, tied: bool, base: float, d_head: int | None = None, **extra: Any) -> ModelConfig:
    fields = dict(norm="rmsnorm", mlp="swiglu", norm_eps=1e-5 if family in ("llama", "mistral", "phi3") else 1e-6,
                  fused_qkv=False, qk_norm=family == "qwen3")
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head, d_mlp=d_mlp,
        d_vocab=d_vocab, n_ctx=n_ctx, tie_word_embeddings=tied, family=family, positional="rotary", rotary_base=base,
        qkv_bias=family == "qwen2", out_bias=False, name=name, **{**fields, **extra},
    )


def _gemma(name: str, family: str, n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_mlp: int, d_vocab: int,
           n_ctx: int, window: int, pattern: int, **extra: Any) -> ModelConfig:
    """Gemma 2 (every other block local, soft-caps) or Gemma 3 text (one global block in `pattern`, q/k norms)."""
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=256, d_mlp=d_mlp,
        d_vocab=d_vocab, n_ctx=n_ctx, norm="rmsnorm_offset", norm_eps=1e-6, mlp="geglu", activation="gelu_pytorch_tanh",
        norm_placement="sandwich", scale_embed=True, tie_word_embeddings=True, family=family, positional="rotary",
        fused_qkv=False, qkv_bias=False, out_bias=False, query_pre_attn_scalar=256.0, sliding_window=window,
        layer_types=tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers)),
        bos_token_id=2, eos_token_id=1, name=name, **extra,
    )


_GEMMA2 = dict(attn_softcap=50.0, final_softcap=30.0)
_GEMMA3 = dict(qk_norm=True, rotary_base=1_000_000.0, local_rotary_base=10000.0)

_LLAMA3 = dict(rope_type="llama3", rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_n_ctx=8192)

PRESETS: dict[str, ModelConfig] = {
    "gpt2": _gpt2("gpt2", 12, 768, 12),
    "gpt2-medium": _gpt2("gpt2-medium", 24, 1024, 16),
    "gpt2-large": _gpt2("gpt2-large", 36, 1280, 20),
    "gpt2-xl": _gpt2("gpt2-xl", 48, 1600, 25),
    "pythia-70m": _pythia("pythia-70m", 6, 512, 8),
    "pythia-160m": _pythia("pythia-160m", 12, 768, 12),
    "pythia-410m": _pythia("pythia-410m", 24, 1024, 16),
    "pythia-1b": _pythia("pythia-1b", 16, 2048, 8),
    "pythia-1.4b": _pythia("pythia-1.4b", 24, 2048, 16),
    "pythia-2.8b": _pythia("pythia-2.8b", 32, 2560, 32),
    "pythia-6.9b": _pythia("pythia-6.9b", 32, 4096, 32, d_vocab=50432),
    "pythia-12b": _pythia("pythia-12b", 36, 5120, 40, d_vocab=50688),
    "llama-3.2-1b": _llama("llama-3.2-1b", "llama", 16, 2048, 32, 8, 8192, 128256, 131072, True, 500000.0,
                           rope_factor=32.0, **_LLAMA3),
    "llama-3.2-3b": _llama("llama-3.2-3b", "llama", 28, 3072, 24, 8, 8192, 128256, 131072, True, 500000.0,
                           rope_factor=32.0, **_LLAMA3),
    "llama-3.1-8b": _llama("llama-3.1-8b", "llama", 32, 4096, 32, 8, 14336, 128256, 131072, False, 500000.0,
                           rope_factor=8.0, **_LLAMA3),
    "mistral-7b": _llama("mistral-7b", "mistral", 32, 4096, 32, 8, 14336, 32000, 32768, False, 10000.0,
                         sliding_window=4096),
    "qwen2.5-0.5b": _llama("qwen2.5-0.5b", "qwen2", 24, 896, 14, 2, 4864, 151936, 32768, True, 1000000.0),
    "qwen2.5-1.5b": _llama("qwen2.5-1.5b", "qwen2", 28, 1536, 12, 2, 8960, 151936, 32768, True, 1000000.0),
    "qwen2.5-7b": _llama("qwen2.5-7b", "qwen2", 28, 3584, 28, 4, 18944, 152064, 131072, False, 1000000.0),
    "qwen3-0.6b": _llama("qwen3-0.6b", "qwen3", 28, 1024, 16, 8, 3072, 151936, 40960, True, 1000000.0, d_head=128),
    "qwen3-1.7b": _llama("qwen3-1.7b", "qwen3", 28, 2048, 16, 8, 6144, 151936, 40960, True, 1000000.0, d_head=128),
    "qwen3-4b": _llama("qwen3-4b", "qwen3", 36, 2560, 32, 8, 9728, 151936, 40960, True, 1000000.0, d_head=128),
    "qwen3-8b": _llama("qwen3-8b", "qwen3", 36, 4096, 32, 8, 12288, 151936, 40960, False, 1000000.0, d_head=128),
    "gemma-2-2b": _gemma("gemma-2-2b", "gemma2", 26, 2304, 8, 4, 9216, 256000, 8192, 4096, 2, **_GEMMA2),
    "gemma-2-9b": _gemma("gemma-2-9b", "gemma2", 42, 3584, 16, 8, 14336, 256000, 8192, 4096, 2, **_GEMMA2),
    "gemma-3-1b": _gemma("gemma-3-1b", "gemma3_text", 26, 1152, 4, 1, 6912, 262144, 32768, 512, 6, **_GEMMA3),
    "gemma-3-4b": _gemma("gemma-3-4b", "gemma3_text", 34, 2560, 8, 4, 10240, 262208, 131072, 1024, 6, **_GEMMA3,
                         rope_type="linear", rope_factor=8.0),  # the text part of Gemma3ForConditionalGeneration
    "olmo-2-1b": _llama("olmo-2-1b", "olmo2", 16, 2048, 16, 16, 8192, 100352, 4096, False, 500000.0, qk_norm=True,
                        qk_norm_per_head=False, norm_placement="post", norm_eps=1e-6, bos_token_id=None, eos_token_id=100257),
    "olmo-2-7b": _llama("olmo-2-7b", "olmo2", 32, 4096, 32, 32, 11008, 100352, 4096, False, 500000.0, qk_norm=True,
                        qk_norm_per_head=False, norm_placement="post", norm_eps=1e-6, bos_token_id=None, eos_token_id=100257),
    "phi-3-mini": _llama("phi-3-mini", "phi3", 32, 3072, 32, 32, 8192, 32064, 4096, False, 10000.0, fused_qkv=True,
                         mlp="swiglu_fused", sliding_window=2047, bos_token_id=1, eos_token_id=32000),
}
"""Published shapes by short name (case-insensitive; an organisation prefix is ignored by `from_name`)."""

"""Model configuration: a frozen dataclass, GPT-2 presets, and conversion from HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
# GPT-2's "gelu_new" and PyTorch's tanh GELU are the same function; "gelu" is the exact erf form.
ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a GPT-2-family model. Derived values live in `__post_init__` only.

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

    def __post_init__(self) -> None:
        if self.d_mlp is None:
            object.__setattr__(self, "d_mlp", 4 * self.d_model)
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "pass d_head explicitly or choose a divisor"
                )
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        for field in ("n_layers", "d_model", "n_heads", "d_vocab", "n_ctx", "d_mlp", "d_head"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"ModelConfig.activation={self.activation!r} is not a GPT-2 activation; "
                f"supported: {sorted(ACTIVATIONS)}"
            )
        if self.norm not in NORMS:
            raise ValueError(f"ModelConfig.norm={self.norm!r}; supported: {NORMS}")
        if self.mlp not in MLPS:
            raise ValueError(f"ModelConfig.mlp={self.mlp!r}; supported: {MLPS}")

    @property
    def gelu_approximate(self) -> str:
        """The `approximate` argument of `torch.nn.functional.gelu` for this activation."""
        return ACTIVATIONS[self.activation]

    @property
    def is_gpt2(self) -> bool:
        """True when the architecture is exactly GPT-2's, so it can be saved in the HF layout."""
        return self.norm == "layernorm" and self.mlp == "gelu" and self.d_head * self.n_heads == self.d_model

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed; derived fields follow unless given explicitly."""
        fields = dataclasses.asdict(self)
        if ("d_model" in changes or "n_heads" in changes) and "d_head" not in changes:
            fields["d_head"] = None
        if "d_model" in changes and "d_mlp" not in changes:
            fields["d_mlp"] = None
        fields.update(changes)
        return ModelConfig(**fields)

    # ------------------------------------------------------------------ presets
    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        """A preset by name: gpt2, gpt2-medium, gpt2-large, gpt2-xl (an `openai-community/` prefix is fine)."""
        key = name.split("/")[-1]
        if key not in PRESETS:
            raise KeyError(f"no preset named {name!r}; presets: {sorted(PRESETS)}")
        return PRESETS[key]

    # ------------------------------------------------------------ HF conversion
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any] | Any, name: str = "custom") -> "ModelConfig":
        """Build from a Hugging Face GPT-2 config (a `GPT2Config` or the dict of `config.json`).

        Anything that would change GPT-2's computation and that lenskit does not implement raises,
        naming the field, rather than being silently ignored.
        """
        d = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
        model_type = d.get("model_type")
        if model_type != "gpt2":
            raise ValueError(f"config field model_type={model_type!r}: lenskit loads GPT-2 models only ('gpt2')")
        refuse = {
            "add_cross_attention": False,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "scale_attn_weights": True,
        }
        for field, supported in refuse.items():
            if field in d and bool(d[field]) != supported:
                raise ValueError(f"config field {field}={d[field]!r} is not supported (lenskit needs {supported})")
        act = d.get("activation_function", "gelu_new")
        if act not in ACTIVATIONS:
            raise ValueError(
                f"config field activation_function={act!r} is not a GPT-2 activation; supported: {sorted(ACTIVATIONS)}"
            )
        required = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"config.json lacks required GPT-2 field(s) {missing}")
        return cls(
            n_layers=int(d["n_layer"]),
            d_model=int(d["n_embd"]),
            n_heads=int(d["n_head"]),
            d_vocab=int(d["vocab_size"]),
            n_ctx=int(d["n_positions"]),
            d_mlp=int(d["n_inner"]) if d.get("n_inner") else None,
            norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
            activation=act,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            initializer_range=float(d.get("initializer_range", 0.02)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            name=name,
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike, name: str = "custom") -> "ModelConfig":
        """Read a Hugging Face `config.json`."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); expected a Hugging Face GPT-2 config.json") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds a {type(data).__name__}, expected a JSON object")
        return cls.from_hf_config(data, name=name)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` that `transformers.GPT2LMHeadModel` reads for this architecture."""
        if not self.is_gpt2:
            raise ValueError(
                f"norm={self.norm!r}, mlp={self.mlp!r}: only the plain GPT-2 architecture has a Hugging Face layout"
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


PRESETS: dict[str, ModelConfig] = {
    "gpt2": _gpt2("gpt2", 12, 768, 12),
    "gpt2-medium": _gpt2("gpt2-medium", 24, 1024, 16),
    "gpt2-large": _gpt2("gpt2-large", 36, 1280, 20),
    "gpt2-xl": _gpt2("gpt2-xl", 48, 1600, 25),
}

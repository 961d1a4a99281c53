"""TransformerLens's names for `ModelConfig`'s fields (`cfg.act_fn`, `cfg.normalization_type`, ...), so that code
written against its config reads lenskit's: aliases derived from the fields, never stored.

Some of TransformerLens's config entries say where a model is, how it takes text and which optional hook points are
on rather than what it is: `cfg.device`, `cfg.dtype`, `cfg.default_prepend_bos` and the `cfg.use_*` switches. They are not dataclass fields (two configs that differ only
in them are equal, and a lens fitted on the CPU fits the model on a GPU); each model keeps its own copy of its config
and records them there (`note_placement`, `note_prepend_bos`, `note_switch`).
"""

from __future__ import annotations

import torch


def note_placement(cfg: object, weight: torch.Tensor) -> None:
    """Record on the model's own config the device and dtype of `weight` (its embedding): `cfg.device`, `cfg.dtype`."""
    object.__setattr__(cfg, "_device", str(weight.device))
    object.__setattr__(cfg, "_dtype", weight.dtype)


SWITCHES = ("use_attn_result", "use_split_qkv_input", "use_attn_in", "use_hook_mlp_in")


def note_switch(cfg: object, switch: str, on: bool) -> None:
    """Record one of TransformerLens's hook-point switches (`model.set_use_attn_result(True)` ...) as `cfg.<switch>`."""
    if switch not in SWITCHES:
        raise ValueError(f"unknown switch {switch!r}; expected one of {SWITCHES}")
    object.__setattr__(cfg, f"_{switch}", bool(on))


def note_prepend_bos(cfg: object, default: bool | None) -> None:
    """Record what text input does about BOS when `prepend_bos` is not given: True, False, or None (follow the
    checkpoint's tokenizer: lenskit's own default)."""
    if default is not None and not isinstance(default, bool):
        raise TypeError(f"default_prepend_bos must be True, False or None, got {default!r}")
    object.__setattr__(cfg, "_default_prepend_bos", default)


class TransformerLensNames:
    """Mixed into `ModelConfig`: each property reads the lenskit field it names. (`original_architecture`, which reads
    the family registry, is ModelConfig's own.)"""

    @property
    def device(self) -> str:
        """Where the model's embedding is, e.g. "cpu" or "cuda:0" (a model spread over devices: its first)."""
        return getattr(self, "_device", "cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's weights (its embedding's)."""
        return getattr(self, "_dtype", torch.float32)

    @property
    def default_prepend_bos(self) -> bool | None:
        """Whether text input gets BOS first when `prepend_bos` is not given; None (lenskit's default): as the
        checkpoint's own tokenizer does. `lenskit.transformer_lens` sets True, as TransformerLens does."""
        return getattr(self, "_default_prepend_bos", None)

    use_attn_result = property(lambda self: getattr(self, "_use_attn_result", False),
                               doc="Whether `model.set_use_attn_result(True)` is on (each head's `hook_result` cached).")
    use_split_qkv_input = property(lambda self: getattr(self, "_use_split_qkv_input", False),
                                   doc="Whether `model.set_use_split_qkv_input(True)` is on.")
    use_attn_in = property(lambda self: getattr(self, "_use_attn_in", False),
                           doc="Whether `model.set_use_attn_in(True)` is on.")
    use_hook_mlp_in = property(lambda self: getattr(self, "_use_hook_mlp_in", False),
                               doc="Whether `model.set_use_hook_mlp_in(True)` is on.")

    @property
    def model_name(self) -> str:
        return self.name

    @property
    def act_fn(self) -> str:
        """The MLP's activation as TransformerLens names it: "silu" for SwiGLU, else the GELU's own name."""
        return "silu" if self.mlp.startswith("swiglu") else self.activation

    @property
    def normalization_type(self) -> str:
        """"LN" (LayerNorm) or "RMS" (RMSNorm, Gemma's (1 + w) form included), as TransformerLens says."""
        return "LN" if self.norm == "layernorm" else "RMS"

    @property
    def n_key_value_heads(self) -> int | None:
        """The key/value head count under grouped-query attention; None where every head has its own (TransformerLens)."""
        return None if self.n_kv_heads == self.n_heads else self.n_kv_heads

    @property
    def eps(self) -> float:
        return self.norm_eps

    @property
    def d_vocab_out(self) -> int:
        return self.d_vocab

    @property
    def positional_embedding_type(self) -> str:
        """"standard" (a learned table), "rotary", or "none" (no positions at all: Nemotron-H)."""
        return {"learned": "standard", "rotary": "rotary"}.get(self.positional, "none")

"""TransformerLens's names for `ModelConfig`'s fields (`cfg.act_fn`, `cfg.normalization_type`, ...), so that code
written against its config reads lenskit's: aliases only, derived from the fields, never stored."""

from __future__ import annotations


class TransformerLensNames:
    """Mixed into `ModelConfig`: each property reads the lenskit field it names."""

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
        """"standard" (a learned table) or "rotary"."""
        return "standard" if self.positional == "learned" else "rotary"

    @property
    def original_architecture(self) -> str:
        """The transformers class of the family, e.g. "LlamaForCausalLM"."""
        from .families import family_of

        return family_of(self.family).hf_class

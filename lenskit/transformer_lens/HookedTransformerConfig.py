"""`transformer_lens.HookedTransformerConfig`: TransformerLens 3's config of a model built from scratch, read into
lenskit's `ModelConfig` (`to_model_config`), so that `HookedTransformer(HookedTransformerConfig(...))` builds a
random model of that shape.

Only what lenskit's pieces compute exactly is accepted. Each other setting, when not at its default, is refused by
name with the reason: attention-only models, LNPre / RMSPre (what `fold_ln` leaves, not a model to train), SoLU
MLPs, shortformer positions, local attention.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lenskit.config import ACTIVATIONS, ModelConfig

# TransformerLens's settings that lenskit does not build, each with the value that means "off" and the reason.
UNSUPPORTED = {
    "attn_only": (False, "lenskit's blocks always have an MLP"),
    "use_local_attn": (False, "local attention is a model's sliding_window; load such a model from its checkpoint"),
    "attention_dir": ("causal", "lenskit's models are decoder-only, causal"),
    "final_rms": (False, "lenskit's final norm follows normalization_type"),
    "post_embedding_ln": (False, "no supported family has a norm after the embedding"),
    "use_hook_tokens": (False, "the token ids are the input; read them there"),
    "scale_attn_by_inverse_layer_idx": (False, "no supported family scales attention by layer"),
    "use_attn_scale": (True, "scores are always scaled"),
    "attn_scale": (-1.0, "scores are scaled by d_head ** -0.5"),
    "num_experts": (None, "build a mixture of experts from a checkpoint's config (lenskit.ModelConfig) instead"),
    "load_in_4bit": (False, "lenskit computes in float32, bfloat16 or float16"),
}


@dataclass
class HookedTransformerConfig:
    """TransformerLens 3's field names and defaults (those lenskit builds); see the module's docstring."""

    n_layers: int
    d_model: int
    n_ctx: int
    d_head: int
    model_name: str = "custom"
    n_heads: int = -1
    d_mlp: int | None = None
    act_fn: str | None = None
    d_vocab: int = -1
    eps: float = 1e-5
    use_attn_result: bool = False
    use_split_qkv_input: bool = False
    use_hook_mlp_in: bool = False
    use_attn_in: bool = False
    original_architecture: str | None = None
    tokenizer_name: str | None = None
    normalization_type: str | None = "LN"
    device: str | None = None
    n_devices: int = 1
    seed: int | None = None
    initializer_range: float = -1.0
    init_weights: bool = True
    positional_embedding_type: str = "standard"
    d_vocab_out: int = -1
    parallel_attn_mlp: bool = False
    rotary_dim: int | None = None
    gated_mlp: bool = False
    default_prepend_bos: bool = True
    dtype: torch.dtype = torch.float32
    n_key_value_heads: int | None = None
    rotary_base: int | float = 10000
    tie_word_embeddings: bool = False
    others: dict[str, Any] = field(default_factory=dict)

    def __init__(self, n_layers: int, d_model: int, n_ctx: int, d_head: int, **kwargs: Any) -> None:
        known = {f.name for f in dataclasses.fields(self)} - {"others"}
        defaults = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
                    for f in dataclasses.fields(self) if f.name not in ("n_layers", "d_model", "n_ctx", "d_head")}
        for name, value in defaults.items():
            setattr(self, name, value)
        self.n_layers, self.d_model, self.n_ctx, self.d_head = n_layers, d_model, n_ctx, d_head
        for name, value in kwargs.items():
            if name in known:
                setattr(self, name, value)
            elif name in UNSUPPORTED:
                off, why = UNSUPPORTED[name]
                if value != off:
                    raise ValueError(f"HookedTransformerConfig({name}={value!r}) is not built by lenskit: {why}")
            else:
                self.others[name] = value
        if self.others:
            raise ValueError(f"HookedTransformerConfig got settings lenskit does not know: {sorted(self.others)}; "
                             "see lenskit.transformer_lens.HookedTransformerConfig for those it builds")
        if self.n_heads == -1:
            self.n_heads = d_model // d_head
        if self.d_mlp is None:
            self.d_mlp = 4 * d_model
        if self.initializer_range < 0:
            self.initializer_range = 0.8 / math.sqrt(d_model)  # TransformerLens's "gpt2" init_mode


def to_model_config(cfg: HookedTransformerConfig | dict, tokenizer: Any = None) -> tuple[ModelConfig, Any]:
    """lenskit's config for TransformerLens's (or a dict of its fields), and the tokenizer it names (local files)."""
    if isinstance(cfg, dict):
        cfg = HookedTransformerConfig(**cfg)
    if not isinstance(cfg, HookedTransformerConfig):
        raise TypeError(f"expected a lenskit ModelConfig, a HookedTransformerConfig or a dict of its fields, "
                        f"got {type(cfg).__name__}")
    if tokenizer is None and cfg.tokenizer_name is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_name, local_files_only=True)
    d_vocab = cfg.d_vocab if cfg.d_vocab != -1 else (len(tokenizer) if tokenizer is not None else -1)
    if d_vocab == -1:
        raise ValueError("HookedTransformerConfig needs d_vocab, or a tokenizer_name to take it from")
    if cfg.d_vocab_out not in (-1, d_vocab):
        raise ValueError(f"d_vocab_out={cfg.d_vocab_out} differs from d_vocab={d_vocab}: lenskit reads out the input vocabulary")
    norm = {"LN": "layernorm", "RMS": "rmsnorm"}.get(cfg.normalization_type)
    if norm is None:
        raise ValueError(f"normalization_type={cfg.normalization_type!r}: lenskit builds 'LN' and 'RMS' (LNPre and "
                         "RMSPre are what fold_ln leaves; build with 'LN' and call process_weights(fold_ln=True))")
    positional = {"standard": "learned", "rotary": "rotary"}.get(cfg.positional_embedding_type)
    if positional is None:
        raise ValueError(f"positional_embedding_type={cfg.positional_embedding_type!r}: lenskit builds 'standard' and 'rotary'")
    act = cfg.act_fn or ("silu" if cfg.gated_mlp else "gelu_new")
    if cfg.gated_mlp and act == "silu":
        mlp, activation = "swiglu", "gelu_new"
    elif cfg.gated_mlp and act in ("gelu_new", "gelu_pytorch_tanh"):
        mlp, activation = "geglu", "gelu_pytorch_tanh"
    elif not cfg.gated_mlp and act in ACTIVATIONS:
        mlp, activation = "gelu", act
    else:
        raise ValueError(f"act_fn={act!r} with gated_mlp={cfg.gated_mlp}: lenskit builds plain MLPs "
                         f"({', '.join(ACTIVATIONS)}), SwiGLU (silu, gated) and GeGLU (gelu_new, gated)")
    family = "gpt2" if positional == "learned" else ("gpt_neox" if cfg.parallel_attn_mlp else "llama")
    bias = family != "llama"
    model_cfg = ModelConfig(
        n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, d_vocab=d_vocab, n_ctx=cfg.n_ctx,
        d_mlp=cfg.d_mlp, d_head=cfg.d_head, norm_eps=cfg.eps, activation=activation, norm=norm, mlp=mlp,
        tie_word_embeddings=cfg.tie_word_embeddings, initializer_range=cfg.initializer_range,
        bos_token_id=getattr(tokenizer, "bos_token_id", None), eos_token_id=getattr(tokenizer, "eos_token_id", None),
        name=cfg.model_name, family=family, n_kv_heads=cfg.n_key_value_heads, positional=positional,
        rotary_dim=cfg.rotary_dim if positional == "rotary" else None, rotary_base=float(cfg.rotary_base),
        parallel_block=cfg.parallel_attn_mlp, fused_qkv=family != "llama", qkv_bias=bias, out_bias=bias,
        mlp_bias=bias,
    )
    return model_cfg, tokenizer

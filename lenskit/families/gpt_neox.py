"""GPT-NeoX (`gpt_neox`, Pythia): the parallel block (attention and MLP both read the block's input), partial rotary,
LayerNorm, GELU; its checkpoints interleave q, k and v per head."""

from __future__ import annotations

from typing import Any

import torch

from ..config import ACTIVATIONS, ModelConfig
from . import writers
from .family import TINY_SHAPE, Family
from .fields import ConfigReader
from .layouts import Layout, Reshape
from .presets import named_presets
from .readers import common_fields, read_heads
from .rope import rope


def read(r: ConfigReader) -> dict[str, Any]:
    act = r.require("hidden_act", ACTIVATIONS, "gelu")
    n_layers = r.n_layers("num_hidden_layers")
    d_model, n_heads = read_heads(r, "hidden_size", "num_attention_heads", must_divide=True)
    bias = r.bool("attention_bias", True)
    return {
        **common_fields(r, bos=0, eos=2),
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads,
        "d_vocab": r.int("vocab_size"), "n_ctx": r.int("max_position_embeddings"), "d_mlp": r.int("intermediate_size"),
        "norm_eps": r.float("layer_norm_eps", 1e-5, positive=True), "activation": act,
        "tie_word_embeddings": r.bool("tie_word_embeddings", False),
        "parallel_block": r.bool("use_parallel_residual", True), "fused_qkv": True, "qkv_bias": bias, "out_bias": bias,
        # transformers 5's GPT-NeoX reads rotary_emb_base and rotary_pct, not the top-level rope_theta of other families
        **rope(r, d_model // n_heads, theta_key="rotary_emb_base", fraction_key="rotary_pct", default_fraction=0.25,
                unread=("rope_theta", "partial_rotary_factor")),
    }


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "intermediate_size": cfg.d_mlp, "max_position_embeddings": cfg.n_ctx, "layer_norm_eps": cfg.norm_eps,
        "hidden_act": cfg.activation, "use_parallel_residual": cfg.parallel_block, "attention_bias": cfg.attention.qkv_bias,
        "rope_parameters": writers.rope_parameters(cfg, partial=True), **writers.common_fields(cfg),
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
    }


def _qkv(t: torch.Tensor, cfg) -> torch.Tensor:
    """NeoX stores q, k, v interleaved per head, [head, 3, d_head, ...]; ours is [3, head, d_head, ...]."""
    rest = t.shape[1:]
    return t.reshape(cfg.n_heads, 3, cfg.d_head, *rest).transpose(0, 1).reshape(-1, *rest)


def _qkv_interleaved(t: torch.Tensor, cfg) -> torch.Tensor:
    """Ours, [3, head, d_head, ...], back to NeoX's per-head interleave [head, 3, d_head, ...]."""
    rest = t.shape[1:]
    return t.reshape(3, cfg.n_heads, cfg.d_head, *rest).transpose(0, 1).reshape(-1, *rest)


NEOX_QKV = Reshape(_qkv, _qkv_interleaved)

LAYOUT = Layout(
    prefix="gpt_neox.", blocks="layers",
    top={"embed.weight": "embed_in.weight", "ln_final.weight": "final_layer_norm.weight",
         "ln_final.bias": "final_layer_norm.bias", "unembed.weight": "embed_out.weight"},
    block={
        "ln1.weight": "input_layernorm.weight", "ln1.bias": "input_layernorm.bias",
        "ln2.weight": "post_attention_layernorm.weight", "ln2.bias": "post_attention_layernorm.bias",
        "attn.qkv.weight": "attention.query_key_value.weight", "attn.qkv.bias": "attention.query_key_value.bias",
        "attn.out.weight": "attention.dense.weight", "attn.out.bias": "attention.dense.bias",
        "mlp.fc_in.weight": "mlp.dense_h_to_4h.weight", "mlp.fc_in.bias": "mlp.dense_h_to_4h.bias",
        "mlp.fc_out.weight": "mlp.dense_4h_to_h.weight", "mlp.fc_out.bias": "mlp.dense_4h_to_h.bias",
    },
    reshape={"attn.qkv.weight": NEOX_QKV, "attn.qkv.bias": NEOX_QKV},
    aliases={"lm_head.weight": "embed_out.weight"},  # transformers 5 names it so in memory, not on disk
    buffers=r"^layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$|^rotary_emb\.inv_freq$",
)


def _pythia(name: str, n_layers: int, d_model: int, n_heads: int, d_vocab: int = 50304) -> ModelConfig:
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_vocab=d_vocab, n_ctx=2048, activation="gelu",
        tie_word_embeddings=False, family="gpt_neox", positional="rotary", rotary_dim=d_model // n_heads // 4,
        parallel_block=True, bos_token_id=0, eos_token_id=0, name=name,
    )


PRESETS = named_presets(
    _pythia("pythia-70m", 6, 512, 8), _pythia("pythia-160m", 12, 768, 12), _pythia("pythia-410m", 24, 1024, 16),
    _pythia("pythia-1b", 16, 2048, 8), _pythia("pythia-1.4b", 24, 2048, 16), _pythia("pythia-2.8b", 32, 2560, 32),
    _pythia("pythia-6.9b", 32, 4096, 32, d_vocab=50432), _pythia("pythia-12b", 36, 5120, 40, d_vocab=50688))

# partial rotary and the parallel block
TINY = dict(TINY_SHAPE, rotary_pct=0.5, rotary_emb_base=1000.0, use_parallel_residual=True, hidden_act="gelu",
            hidden_dropout=0.0, attention_dropout=0.0, layer_norm_eps=1e-5)

FAMILY = Family("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", "Pythia", read, write, LAYOUT, PRESETS, TINY)

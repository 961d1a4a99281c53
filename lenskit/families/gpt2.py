"""GPT-2 (`gpt2`) and the embedded `stdlib-gpt2`: learned positions, pre-LayerNorm blocks with fused q/k/v, a GELU MLP,
biases everywhere, a tied unembedding; its checkpoints store weights as Conv1D's [in, out]."""

from __future__ import annotations

from typing import Any

from ..config import ACTIVATIONS, ModelConfig
from .family import Family
from .fields import ConfigReader
from .layouts import TRANSPOSE, Layout
from .presets import named_presets
from .readers import common_fields, read_heads


# Each family's defaults are transformers 5's for an absent field (its config class built with no arguments; the
# derived ones follow its __post_init__). Sizes stay required: transformers' defaults for them are one published
# model's, never what a config without them meant.
def read(r: ConfigReader) -> dict[str, Any]:
    refuse = {"add_cross_attention": False, "scale_attn_by_inverse_layer_idx": False,
              "reorder_and_upcast_attn": False, "scale_attn_weights": True}
    for field, supported in refuse.items():
        r.require(field, (supported,), supported)
    act = r.d.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ValueError(f"config field activation_function={act!r} is not an activation lenskit builds; supported: {sorted(ACTIVATIONS)}")
    n_layers = r.n_layers("n_layer")
    d_model, n_heads = read_heads(r, "n_embd", "n_head", must_divide=True)
    return {
        **common_fields(r, bos=50256, eos=50256),
        "n_layers": n_layers, "d_model": d_model, "n_heads": n_heads,
        "d_vocab": r.int("vocab_size"), "n_ctx": r.int("n_positions"), "d_mlp": r.int("n_inner", None),
        "norm_eps": r.float("layer_norm_epsilon", 1e-5, positive=True), "activation": act,
        "tie_word_embeddings": r.bool("tie_word_embeddings", True),
    }


def write(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "n_layer": cfg.n_layers, "n_embd": cfg.d_model, "n_head": cfg.n_heads, "n_inner": cfg.d_mlp,
        "vocab_size": cfg.d_vocab, "n_positions": cfg.n_ctx, "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": cfg.activation, "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True, "use_cache": True,
    }


LAYOUT = Layout(
    prefix="transformer.", blocks="h",
    top={"embed.weight": "wte.weight", "pos_embed.weight": "wpe.weight", "ln_final.weight": "ln_f.weight",
         "ln_final.bias": "ln_f.bias", "unembed.weight": "lm_head.weight"},
    block={
        "ln1.weight": "ln_1.weight", "ln1.bias": "ln_1.bias", "ln2.weight": "ln_2.weight", "ln2.bias": "ln_2.bias",
        "attn.qkv.weight": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
        "attn.out.weight": "attn.c_proj.weight", "attn.out.bias": "attn.c_proj.bias",
        "mlp.fc_in.weight": "mlp.c_fc.weight", "mlp.fc_in.bias": "mlp.c_fc.bias",
        "mlp.fc_out.weight": "mlp.c_proj.weight", "mlp.fc_out.bias": "mlp.c_proj.bias",
    },
    # GPT-2's Conv1D stores weights as [in, out]; nn.Linear wants [out, in].
    reshape={k: TRANSPOSE for k in ("attn.qkv.weight", "attn.out.weight", "mlp.fc_in.weight", "mlp.fc_out.weight")},
    buffers=r"^h\.\d+\.attn\.(bias|masked_bias)$",
)


def _preset(name: str, n_layers: int, d_model: int, n_heads: int) -> ModelConfig:
    return ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_vocab=50257, n_ctx=1024,
        bos_token_id=50256, eos_token_id=50256, name=name,
    )


PRESETS = named_presets(_preset("gpt2", 12, 768, 12), _preset("gpt2-medium", 24, 1024, 16),
                        _preset("gpt2-large", 36, 1280, 20), _preset("gpt2-xl", 48, 1600, 25))

TINY = dict(n_layer=3, n_embd=32, n_head=4, vocab_size=101, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

FAMILY = Family("gpt2", "GPT2LMHeadModel", "GPT2Config", "GPT-2, the embedded `stdlib-gpt2`", read, write, LAYOUT,
                PRESETS, TINY, tiny_3_blocks={})

"""Each family's Hugging Face checkpoint layout: key prefix, a declarative name map, the tensors that
need reshaping, and the buffers old checkpoints carry that hold no learned state.

Names inside a block are written once per family as `ours -> theirs`; the full map is generated from
our own state-dict keys, so a bias the config turns off is simply not expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

_GPT2_BLOCK = {
    "ln1.weight": "ln_1.weight", "ln1.bias": "ln_1.bias", "ln2.weight": "ln_2.weight", "ln2.bias": "ln_2.bias",
    "attn.qkv.weight": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
    "attn.out.weight": "attn.c_proj.weight", "attn.out.bias": "attn.c_proj.bias",
    "mlp.fc_in.weight": "mlp.c_fc.weight", "mlp.fc_in.bias": "mlp.c_fc.bias",
    "mlp.fc_out.weight": "mlp.c_proj.weight", "mlp.fc_out.bias": "mlp.c_proj.bias",
}
_NEOX_BLOCK = {
    "ln1.weight": "input_layernorm.weight", "ln1.bias": "input_layernorm.bias",
    "ln2.weight": "post_attention_layernorm.weight", "ln2.bias": "post_attention_layernorm.bias",
    "attn.qkv.weight": "attention.query_key_value.weight", "attn.qkv.bias": "attention.query_key_value.bias",
    "attn.out.weight": "attention.dense.weight", "attn.out.bias": "attention.dense.bias",
    "mlp.fc_in.weight": "mlp.dense_h_to_4h.weight", "mlp.fc_in.bias": "mlp.dense_h_to_4h.bias",
    "mlp.fc_out.weight": "mlp.dense_4h_to_h.weight", "mlp.fc_out.bias": "mlp.dense_4h_to_h.bias",
}
_LLAMA_BLOCK = {
    "ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
    **{f"attn.qkv.{x}.{p}": f"self_attn.{x}_proj.{p}" for x in "qkv" for p in ("weight", "bias")},
    "attn.out.weight": "self_attn.o_proj.weight", "attn.out.bias": "self_attn.o_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
    **{f"mlp.{ours}.{p}": f"mlp.{theirs}.{p}" for ours, theirs in (("gate", "gate_proj"), ("fc_in", "up_proj"),
                                                                    ("fc_out", "down_proj")) for p in ("weight", "bias")},
}


def _transpose(t: torch.Tensor, cfg) -> torch.Tensor:
    """A view, not a copy: a transposed weight is as fast in F.linear (benchmarks/results.md, "Big checkpoints")
    and lets a memory-mapped checkpoint stay mapped."""
    return t.T


def _neox_qkv(t: torch.Tensor, cfg) -> torch.Tensor:
    """NeoX stores q, k, v interleaved per head, [head, 3, d_head, ...]; ours is [3, head, d_head, ...]."""
    rest = t.shape[1:]
    return t.reshape(cfg.n_heads, 3, cfg.d_head, *rest).transpose(0, 1).reshape(-1, *rest)


@dataclass(frozen=True)
class Layout:
    """How one family's checkpoint names and stores our parameters."""

    prefix: str  # the base model's prefix, e.g. "model."; keys may come with or without it
    blocks: str  # the block list inside the base model, e.g. "layers"
    top: dict[str, str]  # ours -> theirs, outside the blocks (the unembedding has no prefix)
    block: dict[str, str]  # ours -> theirs, inside one block
    reshape: dict[str, Callable] = field(default_factory=dict)  # block-local ours -> theirs-to-ours
    buffers: str = r"$^"  # regex, on unprefixed names, of stored buffers to skip
    aliases: dict[str, str] = field(default_factory=dict)  # other spellings -> the file's, e.g. in-memory names

    def name_map(self, our_keys, n_layers: int) -> dict[str, str]:
        """theirs (unprefixed, except the unembedding) -> ours, for every key in `our_keys`."""
        out = {}
        for ours in our_keys:
            if ours.startswith("blocks."):
                _, i, local = ours.split(".", 2)
                if local not in self.block:
                    raise KeyError(f"no checkpoint name for our parameter {ours!r} in this layout")
                out[f"{self.blocks}.{i}.{self.block[local]}"] = ours
            else:
                if ours not in self.top:
                    raise KeyError(f"no checkpoint name for our parameter {ours!r} in this layout")
                out[self.top[ours]] = ours
        return out

    def stored_shape(self, ours: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the checkpoint stores our parameter `ours` of shape `shape` in."""
        return tuple(reversed(shape)) if self.transform(ours) is _transpose else shape

    def transform(self, ours: str) -> Callable | None:
        return self.reshape.get(ours.split(".", 2)[2]) if ours.startswith("blocks.") else None


_LLAMA = Layout(
    prefix="model.", blocks="layers",
    top={"embed.weight": "embed_tokens.weight", "ln_final.weight": "norm.weight", "unembed.weight": "lm_head.weight"},
    block=_LLAMA_BLOCK, buffers=r"^layers\.\d+\.self_attn\.rotary_emb\.inv_freq$",
)
_GEMMA = Layout(
    prefix="model.", blocks="layers",
    top={"embed.weight": "embed_tokens.weight", "ln_final.weight": "norm.weight", "unembed.weight": "lm_head.weight"},
    block={**_LLAMA_BLOCK, "ln1_post.weight": "post_attention_layernorm.weight",
           "ln2.weight": "pre_feedforward_layernorm.weight", "ln2_post.weight": "post_feedforward_layernorm.weight"},
)
_OLMO2 = Layout(  # post-norms only: transformers' post_attention_layernorm follows attention, as our ln1_post does
    prefix="model.", blocks="layers", top=_LLAMA.top,
    block={**_LLAMA_BLOCK, "ln1_post.weight": "post_attention_layernorm.weight",
           "ln2_post.weight": "post_feedforward_layernorm.weight"},
)
_PHI3 = Layout(
    prefix="model.", blocks="layers", top=_LLAMA.top,
    block={**_LLAMA_BLOCK, "attn.qkv.weight": "self_attn.qkv_proj.weight", "mlp.gate_up.weight": "mlp.gate_up_proj.weight"},
)
LAYOUTS: dict[str, Layout] = {
    "gpt2": Layout(
        prefix="transformer.", blocks="h",
        top={"embed.weight": "wte.weight", "pos_embed.weight": "wpe.weight", "ln_final.weight": "ln_f.weight",
             "ln_final.bias": "ln_f.bias", "unembed.weight": "lm_head.weight"},
        block=_GPT2_BLOCK,
        # GPT-2's Conv1D stores weights as [in, out]; nn.Linear wants [out, in].
        reshape={k: _transpose for k in ("attn.qkv.weight", "attn.out.weight", "mlp.fc_in.weight", "mlp.fc_out.weight")},
        buffers=r"^h\.\d+\.attn\.(bias|masked_bias)$",
    ),
    "gpt_neox": Layout(
        prefix="gpt_neox.", blocks="layers",
        top={"embed.weight": "embed_in.weight", "ln_final.weight": "final_layer_norm.weight",
             "ln_final.bias": "final_layer_norm.bias", "unembed.weight": "embed_out.weight"},
        block=_NEOX_BLOCK, reshape={"attn.qkv.weight": _neox_qkv, "attn.qkv.bias": _neox_qkv},
        aliases={"lm_head.weight": "embed_out.weight"},  # transformers 5 names it so in memory, not on disk
        buffers=r"^layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$|^rotary_emb\.inv_freq$",
    ),
    "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _LLAMA,
    "gemma2": _GEMMA, "gemma3_text": _GEMMA, "olmo2": _OLMO2, "phi3": _PHI3,
}


def layout_of(family: str) -> Layout:
    return LAYOUTS[family]


def buffer_pattern(family: str) -> re.Pattern:
    return re.compile(LAYOUTS[family].buffers)

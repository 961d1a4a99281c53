"""Short activation names: the one table behind `cache["resid_post", 3]` and `lenskit.get_act_name`.

A short name is the TransformerLens shorthand for a hook inside a block ("resid_pre", "q", "pattern",
"pre" ...). The residual-stream points come from `lenskit.observe.stream.POINTS`; the rest are listed here.

>>> get_act_name("resid_pre", 3)
'blocks.3.hook_resid_pre'
>>> get_act_name("scale", 2, "ln1"), get_act_name("normalized")
('blocks.2.ln1.hook_scale', 'ln_final.hook_normalized')
>>> get_act_name("k6"), get_act_name("pattern", 0)
('blocks.6.attn.hook_k', 'blocks.0.attn.hook_pattern')
"""

from __future__ import annotations

import re

from ..suggest import did_you_mean
from .stream import POINTS, block_hook_name, check_layer

# Short name -> the hook's path inside block `layer`: the stream points, then attention, MLP and norms.
BLOCK_SHORT: dict[str, str] = {
    **POINTS,
    "q": "attn.hook_q", "k": "attn.hook_k", "v": "attn.hook_v", "z": "attn.hook_z",
    "rot_q": "attn.hook_rot_q", "rot_k": "attn.hook_rot_k",
    "attn_scores": "attn.hook_attn_scores", "pattern": "attn.hook_pattern", "result": "attn.hook_result",
    "pre": "mlp.hook_pre", "pre_linear": "mlp.hook_pre_linear", "post": "mlp.hook_post",
    "router_logits": "mlp.hook_router_logits", "expert_indices": "mlp.hook_expert_indices",
    "expert_weights": "mlp.hook_expert_weights", "expert_out": "mlp.hook_expert_out",
    "q_latent": "attn.hook_q_latent", "kv_latent": "attn.hook_kv_latent", "k_rope": "attn.hook_k_rope",  # latent attention
    "routed_out": "mlp.hook_routed_out", "shared_out": "mlp.hook_shared_out",  # DeepSeek's and Qwen3-Next's shared experts
    "shared_gate": "mlp.hook_shared_gate",  # Qwen3-Next: the sigmoid gate on the shared expert's output
    "rescale_out": "hook_rescale_out",  # Gemma 4: (layer_scalar - 1) * stream, the block's last write
    "per_layer_in": "hook_per_layer_in", "per_layer_out": "hook_per_layer_out",  # Gemma 4 E2B/E4B's per-layer input
    "heads_out": "hook_heads_out", "mamba_out": "hook_mamba_out",  # Falcon-H1: attention's and the Mamba-2 mixer's writes
    "scale1": "ln1.hook_scale", "normalized1": "ln1.hook_normalized",
    "scale2": "ln2.hook_scale", "normalized2": "ln2.hook_normalized",
}
# The layout of each hook's tensor, declared by its path inside a block: the hooks named here are per head
# ([batch, head, query_pos, ...]) or per recurrent state (a linear-attention block's final state); every other
# hook is per token, [batch, pos, ...] (what can be exported as rows, or patched by position).
LAYOUTS = {"attn.hook_attn_scores": "per-head", "attn.hook_pattern": "per-head", "attn.hook_sink": "per-head",
           "attn.hook_state": "per-state", "mamba.hook_state": "per-state"}  # mamba: Falcon-H1's mixer beside attention
HOOK_AXES = {"per-token": ("batch", "pos", "..."), "per-head": ("batch", "head", "query_pos", "..."),
             "per-state": ("batch", "v_head", "d_k", "d_v")}
# Hooks outside the blocks, by short name.
TOP_SHORT = {"embed": "hook_embed", "pos_embed": "hook_pos_embed"}
# TransformerLens's spellings of the same short names.
ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "key": "k", "query": "q", "value": "v",
           "mlp_pre": "pre", "mlp_post": "post",
           "in": "resid_pre", "out": "resid_post"}  # TransformerLens 4's blocks.{i}.hook_in / hook_out: the block's input and output
NORM_SHORT = ("scale", "normalized")  # ambiguous inside a block: which norm is named by layer_type
NORM_TYPES = {"ln1": "1", "ln2": "2"}
# TransformerLens's spellings of the part of a block a hook lives in ("" is the block itself).
LAYER_TYPES = {"a": "attn", "attention": "attn", "m": "mlp", "b": "", "block": "", "blocks": ""}


def hook_name(short: str, layer: int | None = None, n_layers: int | None = None) -> str:
    """Expand a short name: `hook_name("resid_post", 3) == "blocks.3.hook_resid_post"`.

    Layers are blocks; a negative layer counts back from n_layers (see `lenskit.observe.stream.check_layer`).
    """
    if layer is None:
        return short
    if short not in BLOCK_SHORT:
        raise KeyError(f"unknown short hook name {short!r}{did_you_mean(short, BLOCK_SHORT)}; known: {sorted(BLOCK_SHORT)}")
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"a layer must be an int, got {layer!r}")
    if n_layers is not None:
        layer = check_layer(layer, n_layers)
    return block_hook_name(layer, BLOCK_SHORT[short])


_GLUED = re.compile(r"^([a-z_]+?)(\d+)([a-z]\w*)?$")  # "k6", "scale4ln1"


def get_act_name(name: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """The full hook name for a TransformerLens short name, as `transformer_lens.utils.get_act_name` gives it.

    `name` is a short name ("resid_pre", "attn_out", "q", "pattern", "result", "pre", "post", "mlp_out",
    "embed" ...), optionally with the layer glued on ("k6", "scale4ln1"); a full hook name is returned as
    is. `layer_type` picks the norm for "scale" / "normalized" ("ln1", "ln2"); without a layer they name
    the final norm. Layers are block indices >= 0 (no model here to count back from; use
    `cache[name, -1]` for that).
    """
    if not isinstance(name, str):
        raise TypeError(f"get_act_name takes a short name such as 'resid_pre', got {type(name).__name__}")
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    glued = _GLUED.match(name)
    if glued and layer is None:
        name, layer, layer_type = glued[1], int(glued[2]), glued[3] or layer_type
    name = ALIASES.get(name, name)
    if name in NORM_SHORT:
        if layer is None:
            return f"ln_final.hook_{name}"
        if layer_type not in NORM_TYPES:
            raise ValueError(f"{name!r} inside block {layer} needs layer_type 'ln1' or 'ln2' (which norm), got {layer_type!r}")
        name = name + NORM_TYPES[layer_type]
    if name in TOP_SHORT:
        if layer is not None:
            raise ValueError(f"{name!r} is outside the blocks and takes no layer, got layer={layer!r}")
        return TOP_SHORT[name]
    if name not in BLOCK_SHORT:
        known = sorted({*BLOCK_SHORT, *TOP_SHORT, *ALIASES, *NORM_SHORT} - {"scale1", "scale2", "normalized1", "normalized2"})
        raise KeyError(f"unknown activation name {name!r}{did_you_mean(name, known)}; known short names: {', '.join(known)}")
    if layer is None:
        raise ValueError(f"{name!r} lives in every block; pass a layer, e.g. get_act_name({name!r}, 0)")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"get_act_name needs a block index >= 0, got {layer!r}; use cache[{name!r}, layer] to count back")
    part = BLOCK_SHORT[name].rpartition(".")[0]  # "attn", "mlp", "ln1", or "" for the block's own hooks
    if layer_type is not None and LAYER_TYPES.get(layer_type, layer_type) != part:
        raise ValueError(f"{name!r} is {block_hook_name(layer, BLOCK_SHORT[name])!r}, so layer_type must be None"
                         f"{f' or {part!r}' if part else ''}, got {layer_type!r}")
    return block_hook_name(layer, BLOCK_SHORT[name])


def hook_layout(name: str) -> str:
    """"per-token", "per-head" or "per-state": how the tensor at hook `name` is laid out (see LAYOUTS)."""
    path = name.split(".", 2)[2] if name.startswith("blocks.") and name.count(".") >= 2 else name
    return LAYOUTS.get(path, "per-token")


def head_label(layer: int, head: int) -> str:
    """The label of one attention head in stacks and tables, "L{layer}H{head}", as TransformerLens writes it."""
    return f"L{layer}H{head}"

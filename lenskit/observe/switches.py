"""TransformerLens 3's hook-point switches, each off by default, and the hook points they switch on:

- `set_use_attn_result(True)`: `blocks.L.attn.hook_result` [batch, pos, head, d_model] (each head's write, which
  lenskit computes whenever it is hooked) joins `run_with_cache`'s default names.
- `set_use_split_qkv_input(True)`: `blocks.L.hook_q_input` [batch, pos, head, d_model] and `hook_k_input`,
  `hook_v_input` [batch, pos, kv_head, d_model]: the stream before ln1, one copy per head, each normalised by ln1 on
  its own and projected by its own head's W_Q / W_K / W_V, so editing head h's copy changes only what head h reads.
- `set_use_attn_in(True)`: `blocks.L.hook_attn_in` [batch, pos, head, d_model]: one copy per head that its query,
  key and value all read (needs a key/value head per query head).
- `set_use_hook_mlp_in(True)`: `blocks.L.hook_mlp_in` [batch, pos, d_model]: the stream the MLP reads, before
  ln2 (a copy: editing it changes the MLP's input, not the stream).

`HookedTransformer.set_use_*` turn them on and off through `switch`. A switch adds its hook points to the blocks (and `hook_dict`) and chooses, once, how each block reads its input;
switched off, the points go and the blocks read as before, with the same numbers. With a switch on the outputs are
unchanged up to rounding (a per-head projection sums in another order). A switch that cannot apply is refused
before anything changes: per-head inputs need softmax-attention blocks whose heads' q, k and v are projections of
one stream (not Qwen 3.5's linear-attention blocks nor its gated queries, nor Gemma 4's kv-sharing blocks).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config_names import note_switch
from .hooks import HookPoint

if TYPE_CHECKING:
    from ..pieces.forward_state import ForwardState
    from ..pieces.layers import TransformerBlock

SPLIT_POINTS = ("hook_q_input", "hook_k_input", "hook_v_input")


def switch(model: nn.Module, kind: str, on: bool) -> None:
    """Turn `model`'s switch `kind` ("split_qkv", "attn_in", "mlp_in") on or off: the blocks' hook points and
    reading change, then `hook_dict` is rebuilt. `HookedTransformer.set_use_*` call this."""
    if not isinstance(on, bool):
        raise TypeError(f"set_use_{SWITCH_NAMES[kind]} takes True or False, got {on!r}")
    other = {"split_qkv": "attn_in", "attn_in": "split_qkv"}.get(kind)
    if on and other is not None and any(getattr(b, "_input_switch", None) == other for b in model.blocks):
        raise ValueError(f"set_use_{SWITCH_NAMES[kind]}(True): set_use_{SWITCH_NAMES[other]} is on, and a head's "
                         f"input is one or the other; call set_use_{SWITCH_NAMES[other]}(False) first")
    if on:
        _refuse_where_not_applicable(model, kind)
    for block in model.blocks:
        (_switch_mlp_in if kind == "mlp_in" else _switch_attention)(block, kind if on else None)
    model.setup_hooks()
    note_switch(model.cfg, f"use_{SWITCH_NAMES[kind]}", on)


def switched_name_error(name: str) -> KeyError | None:
    """The error for a hook name that exists only while a switch is on, naming the switch; None for other names."""
    for kind, points in SWITCHED_POINTS.items():
        if name.rsplit(".", 1)[-1] in points and name.startswith("blocks."):
            return KeyError(f"{name} exists only while model.set_use_{SWITCH_NAMES[kind]}(True) is on "
                            "(TransformerLens's switch, off by default); turn it on first")
    return None


SWITCH_NAMES = {"split_qkv": "split_qkv_input", "attn_in": "attn_in", "mlp_in": "hook_mlp_in"}
SWITCHED_POINTS = {"split_qkv": SPLIT_POINTS, "attn_in": ("hook_attn_in",), "mlp_in": ("hook_mlp_in",)}


def _refuse_where_not_applicable(model: nn.Module, kind: str) -> None:
    """Refuse, in one line, a per-head input switch on a model whose blocks cannot take one."""
    if kind == "mlp_in":
        return
    name = f"set_use_{SWITCH_NAMES[kind]}(True)"
    linear = [l for l, b in enumerate(model.blocks) if not hasattr(b.attn, "from_projections")]
    if linear:
        raise ValueError(f"{name}: blocks {linear} are {getattr(model.blocks[linear[0]].attn, 'LAYER_TYPE', 'other')} "
                         "layers, which have no per-head q, k, v projections to give separate inputs; "
                         "hook their attn.hook_q/k/v instead")
    sharing = [l for l, b in enumerate(model.blocks) if getattr(b.attn, "kv_source", None) is not None]
    if sharing:
        raise ValueError(f"{name}: blocks {sharing} read an earlier block's keys and values (Gemma 4's kv sharing), so "
                         "they have no key or value input of their own; hook their attn.hook_q / hook_k / hook_v instead")
    if model.cfg.mla.kv_lora_rank is not None:
        raise ValueError(f"{name}: this model's attention is latent (DeepSeek V3): every head's keys and values come from "
                         "one shared latent, with norms between the stream and q, k, v, so there is no per-head input to "
                         "give; hook attn.hook_q / hook_kv_latent / hook_k_rope instead")
    if model.cfg.attention.output_gate:
        raise ValueError(f"{name}: this model's query projection also gives each head an output gate (Qwen 3.5), "
                         "which a per-head query input would have to feed as well; hook attn.hook_q / attn.hook_gate instead")
    if kind == "attn_in":
        grouped = [l for l, b in enumerate(model.blocks) if b.attn.n_kv_heads != b.attn.n_heads]
        if grouped:
            a = model.blocks[grouped[0]].attn
            raise ValueError(f"{name}: blocks {grouped} have {a.n_kv_heads} key/value heads for {a.n_heads} query heads, "
                             "so one input per query head cannot feed the keys and values; use "
                             "set_use_split_qkv_input(True), whose hook_k_input / hook_v_input have kv heads")


# ---------------------------------------------------------------- attention's input
def _switch_attention(block: "TransformerBlock", kind: str | None) -> None:
    """Give `block` the hook points of `kind` ("split_qkv", "attn_in") and its per-head reading, or (None) neither."""
    for name in (*SPLIT_POINTS, "hook_attn_in"):
        if hasattr(block, name):
            delattr(block, name)
    block.__dict__.pop("read_attn", None)  # the class's own reading again
    block._input_switch = kind
    if kind is None:
        return
    for name in SPLIT_POINTS if kind == "split_qkv" else ("hook_attn_in",):
        setattr(block, name, HookPoint())  # [batch, pos, head | kv_head, d_model]
    norm = block.ln1 if block.PRE_NORMS else _unnormalised
    block.read_attn = partial(_read_split if kind == "split_qkv" else _read_attn_in, block, norm)


def _read_split(block: "TransformerBlock", norm: nn.Module, x: torch.Tensor,
                state: "ForwardState | None" = None) -> torch.Tensor:
    """The attention's write from the stream x [batch, pos, d_model], each head's q, k and v read from its own copy."""
    attn = block.attn
    q_in = block.hook_q_input(_per_head(x, attn.n_heads))  # [batch, pos, head, d_model]
    k_in = block.hook_k_input(_per_head(x, attn.n_kv_heads))  # [batch, pos, kv_head, d_model]
    v_in = block.hook_v_input(_per_head(x, attn.n_kv_heads))
    return attn.from_projections(*_project_per_head(attn, norm(q_in), norm(k_in), norm(v_in)), state=state)


def _read_attn_in(block: "TransformerBlock", norm: nn.Module, x: torch.Tensor,
                  state: "ForwardState | None" = None) -> torch.Tensor:
    """The attention's write from x [batch, pos, d_model], each head's q, k and v read from one copy per head."""
    attn = block.attn
    per_head = norm(block.hook_attn_in(_per_head(x, attn.n_heads)))  # [batch, pos, head, d_model]
    return attn.from_projections(*_project_per_head(attn, per_head, per_head, per_head), state=state)


def _per_head(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [batch, pos, d_model] copied n times: [batch, pos, n, d_model] (a copy, so one head's edit stays its own)."""
    return x.unsqueeze(2).repeat(1, 1, n, 1)


def _project_per_head(attn: nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q [batch, pos, head, d_head], k, v [batch, pos, kv_head, d_head] from per-head inputs [batch, pos, head | kv_head,
    d_model]: input h times head h's rows of the projection, plus its bias."""
    out = []
    for x, (weight, bias) in zip(inputs, attn.qkv.parts()):
        w = weight.view(x.shape[2], -1, weight.shape[-1])  # [head, d_head, d_model]
        y = torch.einsum("bphm,hdm->bphd", x, w)
        out.append(y if bias is None else y + bias.view(x.shape[2], -1))
    return tuple(out)


def _unnormalised(x: torch.Tensor) -> torch.Tensor:
    return x  # a post-norm block (OLMo 2) reads the raw stream


# ---------------------------------------------------------------- the MLP's input
def _switch_mlp_in(block: "TransformerBlock", kind: str | None) -> None:
    """Route what the MLP reads through `block.hook_mlp_in` (a copy of the stream before ln2), or (None) stop."""
    reader = getattr(block, "ln2", None) if block.PRE_NORMS else block.mlp  # the MLP's first step: ln2, or the MLP itself (OLMo 2)
    if reader is None:  # a mixer-only block (Nemotron-H's one sublayer): no MLP reads anything
        return
    # Found by what it is, not by a kept handle, so a deep copy of the model (process_weights) switches off as well.
    for key, fn in list(reader._forward_pre_hooks.items()):
        if isinstance(fn, partial) and fn.func is _route_mlp_in:
            del reader._forward_pre_hooks[key]
    if hasattr(block, "hook_mlp_in"):
        delattr(block, "hook_mlp_in")
    if kind is None:
        return
    block.hook_mlp_in = HookPoint()  # [batch, pos, d_model]
    # A pre-hook on that step: the blocks' forwards stay as they are, and only its first input is routed.
    reader.register_forward_pre_hook(partial(_route_mlp_in, block.hook_mlp_in))


def _route_mlp_in(point: HookPoint, module: nn.Module, args: tuple) -> tuple:
    return (point(args[0].clone()), *args[1:])  # a copy: an edit here must not reach the stream


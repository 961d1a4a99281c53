"""The residual stream as a sum of parts, and a norm applied to such parts with a fixed scale.

A pre-norm model only ever adds to its stream, so the stream before a point is exactly

    embed (+ pos_embed) + sum over earlier writes of (attn_out, mlp_out, and any late writes)

where a block's late writes are those after its MLP's, where it has them (`LATE_WRITES`: Gemma 4 E2B/E4B's write from
the block's per-layer input, `hook_per_layer_out`, then Gemma 4's rescaling of the stream by its `layer_scalar`,
`hook_rescale_out`), and each attention write is its heads' writes (`attn.hook_result`) plus the output bias. `resid_parts`
lists those parts from a cache; `ActivationCache.decompose_resid` and `lenses.anatomy` both read it.

A norm is not linear, but with its scale held at the value the whole stream gave it (the cached
`hook_scale`), it is: `pinned_norm` runs the norm's own code with that scale, so the parts of a stream,
each put through it, sum to the norm's output less its bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Container

import torch
from torch import nn

from .names import head_label, hook_name
from .stream import Stream

if TYPE_CHECKING:
    from .cache import ActivationCache

@dataclass(frozen=True)
class Part:
    """One term of a stream decomposition: its tensor [..., pos, d_model] and what wrote it."""

    tensor: torch.Tensor
    label: str  # "embed", "pos_embed", "3_attn_out", "3_mlp_out", "L3H1", "3_attn_bias", "3_per_layer_out", ...
    kind: str  # "embed", "pos_embed", "attn", "mlp", "head", "attn_bias", or a late write's name ("per_layer_out", ...)
    layer: int | None
    head: int | None


# A block's writes after the MLP's, by short name, in the order they are added; a block has those its hooks name.
LATE_WRITES = ("per_layer_out", "rescale_out")  # Gemma 4 E2B/E4B's per-layer input's write, then its layer_scalar


def late_writes(hook_names: "Container[str]", layer: int) -> tuple[str, ...]:
    """The short names of block `layer`'s late writes (see `LATE_WRITES`): those among `hook_names` (a model's
    `hook_dict`, or a cache's names)."""
    return tuple(w for w in LATE_WRITES if hook_name(w, layer) in hook_names)


def need(cache: "ActivationCache", name: str, why: str) -> torch.Tensor:
    """`cache[name]`, or a KeyError that says how to run the model so that the cache holds it."""
    if name not in cache:
        how = ("names_filter=lambda name: True (hook_result is computed only on request)" if name.endswith("hook_result")
               else "no names_filter")
        raise KeyError(f"{why} needs {name!r}, which this cache does not hold; run model.run_with_cache(tokens) with {how}")
    return cache[name]


def resid_parts(cache: "ActivationCache", s: Stream, per_head: bool = False) -> list[Part]:
    """The writes that sum to the stream at `s` (a resolved `resid_pre` / `resid_mid` / `resid_post`).

    The position embedding is a part only where the model has one (learned positions); rotary
    families add positions inside attention. With `per_head`, each attention write becomes its heads
    (`hook_result`) plus an `attn_bias` part, `attn_out - sum(heads)`, so the parts still sum exactly; a
    linear-attention block (Qwen 3.5's Gated DeltaNet), which has no heads, stays one part.
    """
    why = "decomposing the stream"
    embed = need(cache, "hook_embed", why)
    parts = [Part(embed, "embed", "embed", None, None)]
    if has_position_term(cache, embed):
        pos = need(cache, "hook_pos_embed", why).expand_as(embed)  # the same for every sequence
        parts.append(Part(pos, "pos_embed", "pos_embed", None, None))
    n_attn = s.layer + 1 if s.point in ("resid_mid", "resid_post") else s.layer  # blocks whose attention wrote
    n_mlp = s.layer + 1 if s.point == "resid_post" else s.layer  # blocks whose MLP wrote
    for i in range(n_attn):
        attn_out = need(cache, hook_name("attn_out", i), why)
        if per_head and post_normed(cache, i):
            raise ValueError(f"block {i} normalises attention's output (ln1_post) after its heads are summed, so the "
                             "heads do not add up to attn_out; decompose with per_head=False")
        if per_head and not headless(cache, i):  # a linear-attention block has no heads: its write stays whole
            result = need(cache, hook_name("result", i), "a per-head decomposition")  # [..., pos, head, d_model]
            parts += [Part(result[..., h, :], head_label(i, h), "head", i, h) for h in range(result.shape[-2])]
            beside = []  # Falcon-H1: the Mamba-2 mixer's write, added beside the heads'
            if hook_name("mamba_out", i) in (cache if cache.model is None else cache.model.hook_dict):
                beside = [Part(need(cache, hook_name("mamba_out", i), why), f"{i}_mamba_out", "mamba", i, None)]
            parts += beside
            rest = attn_out - result.sum(-2) - sum(p.tensor for p in beside)
            parts.append(Part(rest, f"{i}_attn_bias", "attn_bias", i, None))
        else:
            parts.append(Part(attn_out, f"{i}_attn_out", "attn", i, None))
        if i < n_mlp:
            parts.append(Part(need(cache, hook_name("mlp_out", i), why), f"{i}_mlp_out", "mlp", i, None))
            names = cache if cache.model is None else cache.model.hook_dict
            parts += [Part(need(cache, hook_name(w, i), why), f"{i}_{w}", w, i, None) for w in late_writes(names, i)]
    return parts


def has_position_term(cache: "ActivationCache", embed: torch.Tensor) -> bool:
    """Whether the stream starts as embed + pos_embed (learned positions) rather than embed alone (rotary).

    A learned-position model's cache (known from `cache.model`, else from `hook_pos_embed` being there) needs
    `hook_pos_embed`. Otherwise the first stream must equal the token embedding exactly, checked on
    the first block's input: a position term left out of the cache would make the parts not sum."""
    cfg = getattr(cache.model, "cfg", None)
    if "hook_pos_embed" in cache or (cfg is not None and cfg.positional == "learned"):
        return True
    first = hook_name("resid_pre", 0)
    if first in cache and torch.equal(cache[first], embed):
        return False
    raise KeyError(f"decomposing the stream needs 'hook_pos_embed' (or, for a rotary model, {first!r} "
                   "to confirm there is no position term), which this cache does not hold; run "
                   "model.run_with_cache(tokens) without a names_filter")


def post_normed(cache: "ActivationCache", layer: int, norm: str = "ln1_post") -> bool:
    """Whether block `layer` normalises its attention write after the heads are summed (Gemma, OLMo 2); with
    norm="ln2_post", its MLP's write after the neurons' are summed."""
    name = f"blocks.{layer}.{norm}.hook_normalized"
    return name in cache or (cache.model is not None and name in cache.model.hook_dict)


def headless(cache: "ActivationCache", layer: int) -> str | None:
    """The layer type of block `layer` where its token mixer has no heads' writes (linear attention), else None."""
    return None if cache.model is None else getattr(cache.model.blocks[layer].attn, "LAYER_TYPE", None)


def pinned_norm(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """`norm` applied to `x` [..., d_model] with its divisor fixed at `scale` (broadcast over x's leading
    axes) instead of computed from `x`, without the norm's bias: its linear part at that scale.

    The norm's own code runs (centring for LayerNorm, its gain), with `hook_scale` replaced by `scale`.
    """
    def fixed(computed: torch.Tensor, hook: nn.Module) -> torch.Tensor:
        return scale.to(computed.dtype).expand_as(computed)

    with model.hooks([(norm.hook_scale.name, fixed)]):
        out = norm(x)
        bias = norm(torch.zeros_like(x))  # the norm's output at zero input: its bias (or 0)
    return out - bias

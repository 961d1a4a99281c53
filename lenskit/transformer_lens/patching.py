"""`transformer_lens.patching` under TransformerLens 3's names, argument orders and output layouts, over
`lenskit.patching`: each patch is `lenskit.patching.splice`, each sweep `lenskit.patching.run_patches`.

>>> from lenskit.transformer_lens import patching
>>> clean_tokens = model.to_tokens("def f(self, name):\\n    self.name =")
>>> corrupted_tokens = model.to_tokens("def f(self, path):\\n    self.name =")
>>> name, path = model.to_single_token(" name"), model.to_single_token(" path")
>>> metric = lambda logits: logits[0, -1, name] - logits[0, -1, path]
>>> _, clean_cache = model.run_with_cache(clean_tokens)
>>> patching.get_act_patch_resid_pre(model, corrupted_tokens, clean_cache, metric).shape   # [layer, pos]
torch.Size([6, 12])
>>> patching.get_act_patch_attn_head_all_pos_every(model, corrupted_tokens, clean_cache, metric).shape   # [5, layer, head]
torch.Size([5, 6, 6])

A metric takes logits [batch, pos, d_vocab] and returns a scalar. Under grouped-query attention the k and v sweeps
have one entry per key/value head (kv head j is read by query heads j * group .. (j + 1) * group - 1); the `*_every`
stacks pad them with zeros to n_heads, as TransformerLens does. Linear-attention blocks (Qwen 3.5) have no head
sites: a head sweep over every layer refuses them; pass an `index_df` of the full-attention layers instead.
TransformerLens 4's `reduce=` / `baseline=` (per-example results) are not here.

Direct-path patching (`get_act_patch_direct_path`, TransformerLens 4's newer demos) patches only the edge from one
source head A into one later head B's query, key or value input: A's clean-minus-corrupted write
(z_clean - z_corrupted) @ W_O[A] is added to B's own copy of the block's input (`set_use_split_qkv_input`, switched
on for the sweep and restored after), which B's ln1 then normalises as usual; every other reader of A sees the
corrupted run. This is the exact edge intervention, as TransformerLens 4.3 computes it (its earlier releases held
ln1's scale fixed, an approximation).
"""

from __future__ import annotations

import contextlib
import itertools
from functools import partial
from typing import Callable, Sequence

import pandas as pd
import torch
import torch.nn.functional as F

from ..intervene.patching import HEAD_SITES, check_aligned, check_heads, n_heads_of, run_patches, splice
from ..model import HookedTransformer
from ..observe.cache import ActivationCache
from ..observe.names import get_act_name
from ..observe.stream import POINTS

MetricFn = Callable[[torch.Tensor], torch.Tensor]  # logits [batch, pos, d_vocab] -> scalar
PatchSetter = Callable[[torch.Tensor, Sequence[int], torch.Tensor], torch.Tensor]  # (corrupted, index, clean) -> patched
AXIS_NAMES = ("layer", "pos", "head_index", "head", "src_pos", "dest_pos")
SITE_OF = {**{p: p for p in POINTS}, **{short: site for site, short in HEAD_SITES.items()}}  # short name -> lenskit site


def make_df_from_ranges(column_max_ranges: Sequence[int], column_names: Sequence[str]) -> pd.DataFrame:
    """Every combination of range(m) for each column's m, the last column varying fastest."""
    return pd.DataFrame(list(itertools.product(*(range(m) for m in column_max_ranges))), columns=list(column_names))


# ------------------------------------------------------------------------------------------ setters
# TransformerLens's setters: (corrupted_activation, index, clean_activation) -> patched activation, where index
# starts with the layer. Each is one call of lenskit's splice; the input is left as it was.
def _index(index: Sequence[int], n: int, setter: str) -> list[int]:
    index = list(index)
    if len(index) != n:
        raise ValueError(f"{setter} takes an index of {n} numbers (layer first), got {index}")
    return index


def layer_pos_patch_setter(corrupted_activation, index, clean_activation):
    """index [layer, pos]: one position of an activation [batch, pos, ...] (anything but a pattern)."""
    _, pos = _index(index, 2, "layer_pos_patch_setter")
    return splice(corrupted_activation, clean_activation, "stream", positions=[pos])


def layer_pos_head_vector_patch_setter(corrupted_activation, index, clean_activation):
    """index [layer, pos, head]: one head at one position of q, k, v, z or result [batch, pos, head, ...]."""
    _, pos, head = _index(index, 3, "layer_pos_head_vector_patch_setter")
    return splice(corrupted_activation, clean_activation, "vector", positions=[pos], heads=[head])


def layer_head_vector_patch_setter(corrupted_activation, index, clean_activation):
    """index [layer, head]: one head at every position of q, k, v, z or result [batch, pos, head, ...]."""
    _, head = _index(index, 2, "layer_head_vector_patch_setter")
    return splice(corrupted_activation, clean_activation, "vector", heads=[head])


def layer_head_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index [layer, head]: one head's whole pattern (or scores) [batch, head, dest_pos, src_pos]."""
    _, head = _index(index, 2, "layer_head_pattern_patch_setter")
    return splice(corrupted_activation, clean_activation, "pattern", heads=[head])


def layer_head_pos_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index [layer, head, dest_pos]: one head's pattern row at one destination [batch, head, dest_pos, src_pos]."""
    _, head, dest = _index(index, 3, "layer_head_pos_pattern_patch_setter")
    return splice(corrupted_activation, clean_activation, "pattern", heads=[head], positions=[dest])


def layer_head_dest_src_pos_pattern_patch_setter(corrupted_activation, index, clean_activation):
    """index [layer, head, dest_pos, src_pos]: one entry of one head's pattern [batch, head, dest_pos, src_pos]."""
    _, head, dest, src = _index(index, 4, "layer_head_dest_src_pos_pattern_patch_setter")
    return splice(corrupted_activation, clean_activation, "pattern", heads=[head], positions=[dest], sources=[src])


# ---------------------------------------------------------------------------------------- the sweep
def _grid(model: HookedTransformer, activation_name: str, axes: Sequence[str], n_pos: int) -> pd.DataFrame:
    """TransformerLens's grid over `axes`; heads count kv heads for k and v, the most any block has."""
    unknown = [a for a in axes if a not in AXIS_NAMES]
    if unknown:
        raise ValueError(f"unknown index axis {unknown[0]!r}; expected some of {', '.join(AXIS_NAMES)}")
    if not axes or axes[0] != "layer":
        raise ValueError(f"index_axis_names must start with 'layer', got {list(axes)}")
    site = SITE_OF.get(activation_name)
    n_heads = max(n_heads_of(model, site, layer) for layer in range(model.cfg.n_layers))
    sizes = {"layer": model.cfg.n_layers, "pos": n_pos, "dest_pos": n_pos, "src_pos": n_pos,
             "head_index": n_heads, "head": n_heads}
    return make_df_from_ranges([sizes[a] for a in axes], axes)


def generic_activation_patch(
    model: HookedTransformer,
    corrupted_tokens: torch.Tensor,
    clean_cache: ActivationCache,
    patching_metric: MetricFn,
    patch_setter: PatchSetter,
    activation_name: str,
    index_axis_names: Sequence[str] | None = None,
    index_df: pd.DataFrame | None = None,
    return_index_df: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, pd.DataFrame]:
    """Run `corrupted_tokens` [batch, pos] once per index, with `patch_setter` splicing `clean_cache`'s activation
    `activation_name` of the index's layer (its first entry) into the run, and record `patching_metric`.

    index_axis_names: axes to sweep in full (from AXIS_NAMES, "layer" first); the result has one axis per name,
    e.g. [layer, pos]. index_df: the indices to run instead, one per row; the result is then flat [len(index_df)].
    Returns float32 on `model.cfg.device` when it has one, and (result, index_df) with `return_index_df`.
    """
    if (index_df is None) == (index_axis_names is None):
        raise ValueError("pass exactly one of index_axis_names (a grid to sweep) and index_df (the indices to run)")
    tokens = model.validate_tokens(corrupted_tokens)
    flat = index_df is not None
    if not flat:
        index_df = _grid(model, activation_name, list(index_axis_names), tokens.shape[1])
    indices = [[int(i) for i in row] for row in index_df.itertuples(index=False)]
    site = SITE_OF.get(activation_name)
    if site in HEAD_SITES:
        for layer in sorted({index[0] for index in indices}):
            check_heads(model, site, layer)
    head_axis = next((i for i, a in enumerate(index_df.columns) if a in ("head", "head_index")), None)
    # A head beyond its block's count (Gemma 4's blocks differ in kv heads) is not run; its cell stays 0.
    kept = [(cell, index) for cell, index in enumerate(indices)
            if site not in HEAD_SITES or head_axis is None or index[head_axis] < n_heads_of(model, site, index[0])]

    def patches():
        for _, index in kept:
            name = get_act_name(activation_name, index[0])
            clean = clean_cache[name]

            def hook(x: torch.Tensor, hook, index=index, clean=clean, name=name) -> torch.Tensor:
                check_aligned(name, x, clean)
                return patch_setter(x.clone(), index, clean)  # a setter may write in place; the run's x stays as it was
            yield [(name, hook)]

    def scalar(logits: torch.Tensor) -> torch.Tensor:
        m = torch.as_tensor(patching_metric(logits)).detach()
        if m.numel() != 1:
            raise ValueError(f"patching_metric must return a scalar, got shape {tuple(m.shape)}; average over the batch")
        return m.reshape(()).float()

    metrics = run_patches(model, tokens, scalar, patches(), total=len(kept), progress=None)
    values = torch.zeros(len(indices), device=metrics[0].device if metrics else None)
    values[[cell for cell, _ in kept]] = torch.stack(metrics) if metrics else values[:0]
    out = values if flat else values.reshape([int(index_df[a].max()) + 1 for a in index_df.columns])
    device = getattr(model.cfg, "device", None)
    out = out.to(device) if device is not None else out
    return (out, index_df) if return_index_df else out


def _sweep(setter: PatchSetter, activation_name: str, axes: tuple[str, ...], doc: str):
    sweep = partial(generic_activation_patch, patch_setter=setter, activation_name=activation_name,
                    index_axis_names=axes)
    sweep.__doc__ = f"{doc} `(model, corrupted_tokens, clean_cache, patching_metric)` -> [{', '.join(axes)}]."
    return sweep


get_act_patch_resid_pre = _sweep(
    layer_pos_patch_setter, "resid_pre", ("layer", "pos"),
    "Each block's input, by position.")
get_act_patch_resid_mid = _sweep(
    layer_pos_patch_setter, "resid_mid", ("layer", "pos"),
    "The stream between attention and MLP, by position.")
get_act_patch_attn_out = _sweep(
    layer_pos_patch_setter, "attn_out", ("layer", "pos"),
    "Each attention layer's output, by position.")
get_act_patch_mlp_out = _sweep(
    layer_pos_patch_setter, "mlp_out", ("layer", "pos"),
    "Each MLP's output, by position.")

get_act_patch_attn_head_out_by_pos = _sweep(
    layer_pos_head_vector_patch_setter, "z", ("layer", "pos", "head"),
    "Each head's output (hook_z), by position.")
get_act_patch_attn_head_q_by_pos = _sweep(
    layer_pos_head_vector_patch_setter, "q", ("layer", "pos", "head"),
    "Each head's query, by position.")
get_act_patch_attn_head_k_by_pos = _sweep(
    layer_pos_head_vector_patch_setter, "k", ("layer", "pos", "head"),
    "Each key/value head's key, by position.")
get_act_patch_attn_head_v_by_pos = _sweep(
    layer_pos_head_vector_patch_setter, "v", ("layer", "pos", "head"),
    "Each key/value head's value, by position.")
get_act_patch_attn_head_pattern_by_pos = _sweep(
    layer_head_pos_pattern_patch_setter, "pattern", ("layer", "head_index", "dest_pos"),
    "Each head's pattern, by destination position.")
get_act_patch_attn_head_pattern_dest_src_pos = _sweep(
    layer_head_dest_src_pos_pattern_patch_setter, "pattern", ("layer", "head_index", "dest_pos", "src_pos"),
    "Each entry of each head's pattern.")

get_act_patch_attn_head_out_all_pos = _sweep(
    layer_head_vector_patch_setter, "z", ("layer", "head"),
    "Each head's output (hook_z), every position at once.")
get_act_patch_attn_head_q_all_pos = _sweep(
    layer_head_vector_patch_setter, "q", ("layer", "head"),
    "Each head's query, every position at once.")
get_act_patch_attn_head_k_all_pos = _sweep(
    layer_head_vector_patch_setter, "k", ("layer", "head"),
    "Each key/value head's key, every position at once.")
get_act_patch_attn_head_v_all_pos = _sweep(
    layer_head_vector_patch_setter, "v", ("layer", "head"),
    "Each key/value head's value, every position at once.")
get_act_patch_attn_head_pattern_all_pos = _sweep(
    layer_head_pattern_patch_setter, "pattern", ("layer", "head_index"),
    "Each head's whole pattern.")


def _pad_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Zeros after the last axis's kv heads, up to n_heads (grouped-query attention)."""
    return F.pad(x, (0, n_heads - x.shape[-1]))


def get_act_patch_attn_head_all_pos_every(model, corrupted_tokens, clean_cache, metric) -> torch.Tensor:
    """Every head's out, q, k, v and pattern, every position at once: [5, layer, head] (k, v padded with zeros)."""
    sweeps = (get_act_patch_attn_head_out_all_pos, get_act_patch_attn_head_q_all_pos, get_act_patch_attn_head_k_all_pos,
              get_act_patch_attn_head_v_all_pos, get_act_patch_attn_head_pattern_all_pos)
    n = model.cfg.n_heads
    return torch.stack([_pad_heads(s(model, corrupted_tokens, clean_cache, metric), n) for s in sweeps])


def get_act_patch_attn_head_by_pos_every(model, corrupted_tokens, clean_cache, metric) -> torch.Tensor:
    """Every head's out, q, k, v and pattern (by destination), by position: [5, layer, pos, head]."""
    sweeps = (get_act_patch_attn_head_out_by_pos, get_act_patch_attn_head_q_by_pos, get_act_patch_attn_head_k_by_pos,
              get_act_patch_attn_head_v_by_pos)
    n = model.cfg.n_heads
    stacked = [_pad_heads(s(model, corrupted_tokens, clean_cache, metric), n) for s in sweeps]
    pattern = get_act_patch_attn_head_pattern_by_pos(model, corrupted_tokens, clean_cache, metric)  # [layer, head, pos]
    return torch.stack([*stacked, pattern.transpose(1, 2)])


def get_act_patch_block_every(model, corrupted_tokens, clean_cache, metric) -> torch.Tensor:
    """Each block's input, attention output and MLP output, by position: [3, layer, pos]."""
    sweeps = (get_act_patch_resid_pre, get_act_patch_attn_out, get_act_patch_mlp_out)
    return torch.stack([s(model, corrupted_tokens, clean_cache, metric) for s in sweeps])


def _check_direct_path(model: HookedTransformer, component: str, src_layer: int, src_head: int) -> None:
    if component not in ("q", "k", "v"):
        raise ValueError(f"component must be 'q', 'k' or 'v', got {component!r}")
    if component != "q" and model.cfg.n_kv_heads != model.cfg.n_heads:
        raise ValueError(f"component={component!r}: key/value heads are shared under grouped-query attention "
                         f"({model.cfg.n_kv_heads} for {model.cfg.n_heads} query heads); patch 'q'")
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    if not (0 <= src_layer < n_layers and 0 <= src_head < n_heads):
        raise ValueError(f"source head ({src_layer}, {src_head}) is outside this model's {n_layers} layers x "
                         f"{n_heads} heads")


def get_act_patch_direct_path(model: HookedTransformer, corrupted_tokens: torch.Tensor, clean_cache: ActivationCache,
                              corrupted_cache: ActivationCache, patching_metric: MetricFn, src_layer: int,
                              src_head: int, component: str = "q", verbose: bool = True) -> torch.Tensor:
    """The metric [n_layers, n_heads] with the edge from head (src_layer, src_head) into each later head's
    `component` input ('q', 'k' or 'v') patched to the clean run (see the module's docstring); 0 for heads at or
    before the source layer, which it cannot reach. Both caches hold `blocks.{src_layer}.attn.hook_z`."""
    _check_direct_path(model, component, src_layer, src_head)
    name = f"blocks.{src_layer}.attn.hook_z"
    W_O = model.blocks[src_layer].attn.W_O[src_head]  # [d_head, d_model]
    delta = clean_cache[name][:, :, src_head] @ W_O - corrupted_cache[name][:, :, src_head] @ W_O  # [batch, pos, d_model]
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    results = torch.zeros(n_layers, n_heads, device=model.cfg.device)
    pairs = [(layer, head) for layer in range(src_layer + 1, n_layers) for head in range(n_heads)]
    if verbose:
        from tqdm.auto import tqdm

        pairs = tqdm(pairs, desc=f"direct path ({src_layer}, {src_head}) -> {component}")
    with _split_inputs(model):
        for layer, head in pairs:
            def add(value: torch.Tensor, hook=None, head=head) -> torch.Tensor:
                value = value.clone()  # [batch, pos, head, d_model]: each head's own copy of the block's input
                value[:, :, head] += delta.to(value.dtype)
                return value

            logits = model.run_with_hooks(corrupted_tokens, fwd_hooks=[(f"blocks.{layer}.hook_{component}_input", add)])
            results[layer, head] = patching_metric(logits).item()
    return results


def get_act_patch_direct_path_all_sources(model: HookedTransformer, corrupted_tokens: torch.Tensor,
                                          clean_cache: ActivationCache, corrupted_cache: ActivationCache,
                                          patching_metric: MetricFn, component: str = "q",
                                          verbose: bool = True) -> torch.Tensor:
    """`get_act_patch_direct_path` from every source head: [src_layer, src_head, dst_layer, dst_head] (one run per
    pair, so for small models or a few sources)."""
    _check_direct_path(model, component, 0, 0)
    return torch.stack([torch.stack([get_act_patch_direct_path(model, corrupted_tokens, clean_cache, corrupted_cache,
                                                               patching_metric, layer, head, component, verbose=False)
                                     for head in range(model.cfg.n_heads)]) for layer in range(model.cfg.n_layers)])


@contextlib.contextmanager
def _split_inputs(model: HookedTransformer):
    """`set_use_split_qkv_input(True)` for the body, the caller's switches restored after (also on an error)."""
    had_split = any(getattr(b, "_input_switch", None) == "split_qkv" for b in model.blocks)
    had_attn_in = any(getattr(b, "_input_switch", None) == "attn_in" for b in model.blocks)
    try:
        if had_attn_in:
            model.set_use_attn_in(False)
        model.set_use_split_qkv_input(True)
        yield
    finally:
        model.set_use_split_qkv_input(had_split)
        if had_attn_in:
            model.set_use_attn_in(True)

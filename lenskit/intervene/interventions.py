"""Ablations as hook factories: knock out blocks, sublayer writes, attention heads or MLP neurons.

One call turns any mix of targets into ordinary `(hook name, fn)` pairs, so ablations compose with
`run_with_hooks`, `hooks()` and `run_with_cache` like any other hook:

>>> hooks = ablation_hooks(model, [Block(3), Head(1, 2), Neurons(0, [5, 7])], mode="mean", reference=tokens)
>>> logits = model.run_with_hooks(prompt, fwd_hooks=hooks)
>>> logits, cache = model.run_with_cache(prompt, fwd_hooks=hooks)   # the cache sees the ablated run
>>> _, zeroed = model.run_with_cache(prompt, fwd_hooks=ablation_hooks(model, Block(3), mode="zero"))
>>> torch.equal(zeroed["resid_post", 3], zeroed["resid_pre", 3])   # block 3 zero-ablated: it writes nothing
True

Where each target acts (a "site" is a hook point plus the slice of it that is replaced):

    Block(L)          blocks.L.hook_attn_out and blocks.L.hook_mlp_out   the whole write of the block (and its late
                      writes, Gemma 4's blocks.L.hook_rescale_out, see lenskit.observe.resid)
    Attn(L)           blocks.L.hook_attn_out                             [batch, pos, d_model]
    Mlp(L)            blocks.L.hook_mlp_out                              [batch, pos, d_model]
    Head(L, h)        blocks.L.attn.hook_z                               [:, :, h, :] of [batch, pos, head, d_head]
    Neurons(L, [i])   blocks.L.mlp.hook_post                             [:, :, i] of [batch, pos, d_mlp]
    Stream(L, point)  its hook (`lenskit.Stream`), e.g. Stream(2, "attn_out") is Attn(2)  [batch, pos, d_model]
    Feature(sae, [i]) <hook>.hook_sae_acts_post, inside `model.saes([sae])`  [:, :, i] of [batch, pos, d_sae]

A head is ablated through its `z`, the input to the output projection, so the head's write is
`W_O[h] @ z_h`; the projection's bias belongs to no head and stays.

Modes, for what replaces the selected slice:

- "zero": zeros. For `Block(L)` this skips the block: `resid_post[L] == resid_pre[L]` exactly.
- "mean": the mean of the activation over every token of `reference` (a `[batch, pos]` tensor, or an
  iterable of token tensors); with `per_position=True`, the mean over the batch at each position.
- "resample": the activation the model produced for another input: each row of the input gets one row
  of `reference` (drawn with `resample_indices(n_reference, batch, seed)`), at the same positions.
  All targets of one call take their values from that same row, so a resampled block writes exactly
  what it wrote on the other input.

Reference statistics come from a plain run of the model on `reference`, computed once, when the hooks are
made. `positions` restricts the ablation to some positions (all by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence, Union

import torch

from ..model import HookedTransformer
from ..observe.cache import hook_name
from ..observe.hooks import HookFn
from ..observe.resid import late_writes
from ..observe.stream import Stream, check_layer
from ..saes.features import Feature, check_spliced
from .masks import indices, positions_here, replace_where, sequence_rows

TokensRef = Union[torch.Tensor, Iterable[torch.Tensor]]


# --------------------------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class Block:
    """The whole block `layer`: both of its writes to the residual stream."""

    layer: int


@dataclass(frozen=True)
class Attn:
    """The attention sublayer's write (`hook_attn_out`) in block `layer`."""

    layer: int


@dataclass(frozen=True)
class Mlp:
    """The MLP sublayer's write (`hook_mlp_out`) in block `layer`."""

    layer: int


@dataclass(frozen=True)
class Head:
    """One or several attention heads of block `layer`: `Head(1, 2)` or `Head(1, [0, 2])`."""

    layer: int
    heads: tuple[int, ...]

    def __init__(self, layer: int, heads: int | Iterable[int]) -> None:
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "heads", indices(heads, "heads"))


@dataclass(frozen=True)
class Neurons:
    """MLP neurons (indices into `d_mlp`, after the activation function) of block `layer`."""

    layer: int
    neurons: tuple[int, ...]

    def __init__(self, layer: int, neurons: int | Iterable[int]) -> None:
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "neurons", indices(neurons, "neurons"))


Target = Union[Block, Attn, Mlp, Head, Neurons, Stream, Feature]  # a Stream target replaces that whole stream activation


@dataclass(frozen=True)
class Site:
    """A hook point and the units along `axis` to replace there (`units=None`: the whole tensor)."""

    name: str
    axis: int | None = None
    units: tuple[int, ...] | None = None


def _check_layer(target: Target, n_layers: int) -> int:
    try:
        return check_layer(target.layer, n_layers)
    except (TypeError, IndexError) as e:
        raise type(e)(f"{target!r}: {e}") from None


def _check_units(target: Target, units: tuple[int, ...], size: int, what: str) -> tuple[int, ...]:
    if not units:
        raise ValueError(f"{target!r}: no {what}s given; name at least one")
    bad = [u for u in units if not -size <= u < size]
    if bad:
        raise IndexError(f"{target!r}: {what} {bad[0]} is out of range; block {target.layer} has {size} {what}s "
                         f"(0..{size - 1})")
    return tuple(sorted({u % size for u in units}))


def target_sites(model: HookedTransformer, target: Target) -> list[Site]:
    """The hook points (and slices) an ablation of `target` replaces, after checking it against the model."""
    cfg = model.cfg
    if isinstance(target, Stream):
        return [Site(target.hook_name(cfg.n_layers))]
    if isinstance(target, Feature):  # acts_post: [batch, pos, d_sae], present while its SAE is spliced
        return [Site(check_spliced(model, target), axis=2, units=target.index)]
    if not isinstance(target, (Block, Attn, Mlp, Head, Neurons)):
        raise TypeError(f"an ablation target must be Block, Attn, Mlp, Head, Neurons, a Stream or an SAE Feature, got {target!r}"
                        + ("; experts are ablated by lenskit.intervene.experts.expert_ablation_hooks"
                           if type(target).__name__ == "Expert" else ""))
    layer = _check_layer(target, cfg.n_layers)
    if isinstance(target, Block):
        return [Site(hook_name(w, layer)) for w in ("attn_out", "mlp_out", *late_writes(model.hook_dict, layer))]
    if isinstance(target, Attn):
        return [Site(hook_name("attn_out", layer))]
    if isinstance(target, Mlp):
        return [Site(hook_name("mlp_out", layer))]
    if isinstance(target, Head) and not cfg.has_heads(layer):
        kind = getattr(model.blocks[layer].attn, "LAYER_TYPE", cfg.layer_type(layer))
        raise ValueError(f"{target!r}: block {layer} is a {kind} layer, which has no attention heads to ablate; "
                         "ablate the whole sublayer (Attn) or a full-attention block's heads")
    if isinstance(target, Head):
        heads = _check_units(target, target.heads, cfg.n_heads, "head")
        return [Site(hook_name("z", layer), axis=2, units=heads)]  # z: [batch, pos, head, d_head]
    if not cfg.has_mlp(layer):
        raise ValueError(f"{target!r}: block {layer} is a {cfg.layer_type(layer)} block with no MLP (one sublayer per "
                         f"block, Nemotron-H's), so it has no neurons; ablate the neurons of an 'mlp' block "
                         f"({[l for l in range(cfg.n_layers) if cfg.has_mlp(l)]})")
    if cfg.is_moe_layer(layer):
        raise ValueError(f"{target!r}: block {layer} is a mixture of experts, whose MLP has no single d_mlp neurons; "
                         "ablate an expert instead (lenskit.intervene.experts.Expert)")
    neurons = _check_units(target, target.neurons, cfg.d_mlp, "neuron")
    return [Site(hook_name("post", layer), axis=2, units=neurons)]  # post: [batch, pos, d_mlp]


def merge_sites(sites: Iterable[Site]) -> list[Site]:
    """One site per hook point: unions of units, and a whole-tensor site absorbs any slice of it."""
    merged: dict[str, Site] = {}
    for site in sites:
        old = merged.get(site.name)
        if old is None:
            merged[site.name] = site
        elif old.units is None or site.units is None:
            merged[site.name] = Site(site.name)
        else:
            merged[site.name] = Site(site.name, site.axis, tuple(sorted(set(old.units) | set(site.units))))
    return list(merged.values())


# ----------------------------------------------------------------------------------- reference data
def _reference_batches(reference: TokensRef, batch_size: int) -> Iterator[torch.Tensor]:
    """[batch, pos] token tensors: a 2-D tensor is split into row chunks; an iterable yields its items."""
    if isinstance(reference, torch.Tensor):
        ref = reference.unsqueeze(0) if reference.ndim == 1 else reference
        if ref.ndim != 2 or ref.numel() == 0:
            raise ValueError(f"reference tokens must be a non-empty [batch, pos] tensor, got shape {tuple(reference.shape)}")
        yield from ref.split(batch_size)
        return
    if isinstance(reference, str):
        raise TypeError("reference must be token ids, not text; tokenize it first (model.to_tokens)")
    n = 0
    for item in reference:
        item = torch.as_tensor(item)
        yield item.unsqueeze(0) if item.ndim == 1 else item
        n += 1
    if n == 0:
        raise ValueError("the reference dataset is empty; mean and resample ablations need reference tokens")


@torch.no_grad()
def mean_activations(model: HookedTransformer, names: Sequence[str], reference: TokensRef, *, per_position: bool = False,
                     batch_size: int = 16) -> dict[str, torch.Tensor]:
    """Mean of each named activation over the reference tokens.

    Pooled (default): over every token, shape [*feature] (e.g. [d_model], [head, d_head]).
    `per_position`: over the batch at each position, shape [pos, *feature]; with reference sequences
    of different lengths, each position is averaged over the sequences that reach it.
    """
    sums: dict[str, torch.Tensor] = {}
    counts = torch.zeros(0, dtype=torch.float64)  # tokens seen at each position
    for tokens in _reference_batches(reference, batch_size):
        _, cache = model.run_with_cache(tokens, names_filter=list(names), return_logits=False)
        batch, pos = tokens.shape
        if pos > counts.shape[0]:  # a longer sequence than any before: extend the accumulators
            grow = pos - counts.shape[0]
            counts = torch.cat([counts, counts.new_zeros(grow)])
            sums = {k: torch.cat([s, s.new_zeros(grow, *s.shape[1:])]) for k, s in sums.items()}
        counts[:pos] += batch
        for name in names:
            total = cache[name].double().sum(0)  # [pos, *feature]; float64, as reference sets can be long
            if name not in sums:
                sums[name] = total.new_zeros(counts.shape[0], *total.shape[1:])
            sums[name][:pos] += total
    out = {}
    for name, s in sums.items():
        if per_position:
            mean = s / counts.to(s.device).view(-1, *[1] * (s.ndim - 1))
        else:
            mean = s.sum(0) / counts.sum()
        out[name] = mean.to(model.embed.weight.dtype)
    return out


def resample_indices(n_reference: int, batch: int, seed: int) -> torch.Tensor:
    """Which reference row each input row takes its activations from: a function of the seed alone."""
    return torch.randint(n_reference, (batch,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _reference_cache(model: HookedTransformer, names: Sequence[str], reference: TokensRef) -> dict[str, torch.Tensor]:
    if isinstance(reference, torch.Tensor):
        ref = reference.unsqueeze(0) if reference.ndim == 1 else reference
    else:
        rows = [torch.as_tensor(r) for r in reference]
        lengths = {r.shape[-1] for r in rows}
        if len(lengths) != 1:
            raise ValueError(f"resample needs reference sequences of one length, got lengths {sorted(lengths)}; "
                             "cut them into equal windows")
        ref = torch.cat([r.reshape(-1, r.shape[-1]) for r in rows])
    _, cache = model.run_with_cache(ref, names_filter=list(names), return_logits=False)
    return {name: cache[name] for name in names}


# ------------------------------------------------------------------------------------------ hooks
ValueFor = Callable[[torch.Tensor], torch.Tensor]  # the activation x -> what replaces it (broadcastable to x)


def _replace(site: Site, positions: tuple[int, ...] | None, value_for: ValueFor) -> HookFn:
    """A hook that swaps the site's slice, at the chosen positions, for `value_for(x)`."""

    def hook(x: torch.Tensor, hook) -> torch.Tensor:
        here = positions_here(positions, x.shape[1], "ablation")
        return replace_where(x, value_for(x), here, site.axis, site.units)

    return hook


def zero_values(model: HookedTransformer, names: Sequence[str], reference: TokensRef | None, *, per_position: bool,
                seed: int, batch_size: int) -> dict[str, ValueFor]:
    """Mode "zero": zeros everywhere."""
    return {name: (lambda x: x.new_zeros(())) for name in names}


def mean_values(model: HookedTransformer, names: Sequence[str], reference: TokensRef, *, per_position: bool,
                seed: int, batch_size: int) -> dict[str, ValueFor]:
    """Mode "mean": each activation's mean over the reference tokens (per position with `per_position`)."""
    means = mean_activations(model, names, reference, per_position=per_position, batch_size=batch_size)

    def mean_of(m: torch.Tensor) -> ValueFor:
        if not per_position:
            return lambda x: m  # [*feature] broadcasts over [batch, pos]

        def at_positions(x: torch.Tensor) -> torch.Tensor:
            rows = sequence_rows(x.shape[1])  # the absolute positions, also under a KV cache
            if rows.stop > m.shape[0]:
                raise ValueError(f"per-position mean ablation: the input has {rows.stop} positions but the "
                                 f"reference only {m.shape[0]}; use longer reference sequences or per_position=False")
            return m[rows]  # [pos, *feature]
        return at_positions

    return {name: mean_of(means[name]) for name in names}


def resampled_values(model: HookedTransformer, names: Sequence[str], reference: TokensRef, *, per_position: bool,
                     seed: int, batch_size: int) -> dict[str, ValueFor]:
    """Mode "resample": the activation of a reference row (drawn by `seed`), the same row for every site."""
    acts = _reference_cache(model, names, reference)

    def from_reference(a: torch.Tensor) -> ValueFor:  # a: [n_reference, ref_pos, *feature]
        def value(x: torch.Tensor) -> torch.Tensor:
            at = sequence_rows(x.shape[1])  # the absolute positions, also under a KV cache
            if at.stop > a.shape[1]:
                raise ValueError(f"resample ablation: the input has {at.stop} positions but the reference rows "
                                 f"only {a.shape[1]}; use reference sequences at least as long as the input")
            rows = resample_indices(a.shape[0], x.shape[0], seed).to(a.device)
            return a[rows, at]  # [batch, pos, *feature]
        return value

    return {name: from_reference(acts[name]) for name in names}


# Each mode makes, once, per hook name, a function from the activation to what replaces it.
MODES: dict[str, Callable[..., dict[str, ValueFor]]] = {"zero": zero_values, "mean": mean_values, "resample": resampled_values}


def ablation_hooks(
    model: HookedTransformer,
    targets: Target | Sequence[Target],
    mode: str = "zero",
    *,
    reference: TokensRef | None = None,
    per_position: bool = False,
    seed: int = 0,
    positions: int | Sequence[int] | None = None,
    batch_size: int = 16,
) -> list[tuple[str, HookFn]]:
    """Hooks that ablate every target at once; pass them as `fwd_hooks` (see the module docstring).

    mode: "zero", "mean" (over `reference`) or "resample" (rows of `reference`, drawn with `seed`).
    reference: token ids, [batch, pos] or an iterable of token tensors; needed by "mean" and "resample".
    per_position: for "mean", average over the batch at each position instead of over every token.
    positions: ablate only these positions of the input (default: all).
    """
    if mode not in MODES:
        raise ValueError(f"unknown ablation mode {mode!r}; expected one of {', '.join(MODES)}")
    targets = [targets] if isinstance(targets, (Block, Attn, Mlp, Head, Neurons, Stream, Feature)) else list(targets)
    if not targets:
        raise ValueError("no ablation targets given; pass e.g. [Block(3)] or [Head(1, 2)]")
    sites = merge_sites(s for t in targets for s in target_sites(model, t))
    if mode != "zero" and reference is None:
        raise ValueError(f'mode "{mode}" needs reference tokens (reference=...), e.g. a batch of held-out text')
    if positions is not None:
        positions = indices(positions, "positions")
    values = MODES[mode](model, [s.name for s in sites], reference, per_position=per_position, seed=seed,
                         batch_size=batch_size)
    return [(s.name, _replace(s, positions, values[s.name])) for s in sites]

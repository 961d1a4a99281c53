"""Which entries of an activation an edit replaces: positions along `pos`, and units (heads, neurons) along one axis
(`selection_mask`), or any indices along any axes (`along_mask`: an attention pattern's heads, queries and keys).

Ablation (`lenskit.intervene.interventions`) and patching (`lenskit.intervene.patching`) both edit an activation
[batch, pos, ...] by `torch.where(mask, value, x)`; this module builds that mask, once.
"""

from __future__ import annotations

import operator
from typing import Iterable, Mapping, Sequence

import torch

from ..observe.hook_context import forward_start


def indices(values: int | Iterable[int] | torch.Tensor, what: str) -> tuple[int, ...]:
    """`values` (one index, a sequence of them, or an integer tensor) as a tuple of ints. A bool, a float or a
    string is refused by name (TypeError), never rounded: `1.9` or `True` as an expert is a mistake, not expert 1."""
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.dtype == torch.bool:
            raise TypeError(f"{what} must be integers, got a {values.dtype} tensor")
        return tuple(values.flatten().tolist())
    items = [values] if not isinstance(values, Iterable) or isinstance(values, (str, bytes)) else list(values)
    out = []
    for v in items:
        try:
            if isinstance(v, (bool, str, bytes)) or getattr(v, "dtype", None) == torch.bool:
                raise TypeError
            out.append(operator.index(v))  # ints, numpy and 0-d torch integers; refuses floats
        except TypeError:
            raise TypeError(f"{what} must be integers, got {type(v).__name__} {v!r}") from None
    return tuple(out)


def check_positions(positions: Sequence[int] | None, n_pos: int, what: str) -> None:
    """IndexError unless every position is in range for an input of `n_pos` positions (negatives count back)."""
    bad = [p for p in positions or () if not -n_pos <= p < n_pos]
    if bad:
        raise IndexError(f"{what} position {bad[0]} is out of range for an input of {n_pos} positions")


def positions_here(positions: Sequence[int] | None, n_pos: int, what: str) -> Sequence[int] | None:
    """`positions`, absolute positions in the sequence, as indices into the running forward's `n_pos` positions.

    Without a KV cache they are the same (checked in range; negatives count back). In a forward given a cache, the
    tokens start at the cache's length, so position p is index p - start, and positions outside this forward's
    tokens select nothing here (earlier ones were edited when they ran, later ones will be); a negative position is
    refused there, since it would name another token at each step."""
    start = forward_start()
    if start is None or positions is None:
        check_positions(positions, n_pos, what)
        return positions
    if any(p < 0 for p in positions):
        raise IndexError(f"{what} position {min(positions)} counts back from the end, which under a KV cache is another "
                         "token at each step; give absolute positions (from the sequence's start)")
    return [p - start for p in positions if start <= p < start + n_pos]


def sequence_rows(n_pos: int) -> slice:
    """The absolute positions the running forward's `n_pos` tokens hold (from the KV cache's length under one), as a
    slice of a per-position table [pos, ...]."""
    start = forward_start() or 0
    return slice(start, start + n_pos)


def along_mask(x: torch.Tensor, selections: Mapping[int, Sequence[int] | None]) -> torch.Tensor:
    """A bool mask that broadcasts against x: True where the index along each axis of `selections` is one of that
    axis's indices (all of them when None). Empty lists select nothing; axes not named are not restricted."""
    # Built on the CPU and sent without waiting: indexing a GPU tensor with a Python list would stall the host.
    mask = torch.ones([1] * x.ndim, dtype=torch.bool)
    for axis, chosen in selections.items():
        along = torch.zeros(x.shape[axis], dtype=torch.bool)
        along[slice(None) if chosen is None else list(chosen)] = True
        shape = [1] * x.ndim
        shape[axis] = x.shape[axis]
        mask = mask & along.view(shape)
    return mask.to(x.device, non_blocking=True)


def selection_mask(x: torch.Tensor, positions: Sequence[int] | None = None, axis: int | None = None,
                   units: Sequence[int] | None = None) -> torch.Tensor:
    """A bool mask that broadcasts against x [batch, pos, ...]: True at `positions` (all when None) and, with
    `axis`, at `units` along that axis (all when None). Empty lists select nothing."""
    return along_mask(x, {1: positions} if axis is None else {1: positions, axis: units})


def replace_where(x: torch.Tensor, value: torch.Tensor, positions: Sequence[int] | None = None, axis: int | None = None,
                  units: Sequence[int] | None = None) -> torch.Tensor:
    """x with the selected entries (see `selection_mask`) taken from `value` (broadcastable to x, cast to x's dtype)."""
    return torch.where(selection_mask(x, positions, axis, units), value.to(x.dtype), x)


def replace_along(x: torch.Tensor, value: torch.Tensor, selections: Mapping[int, Sequence[int] | None]) -> torch.Tensor:
    """x with the entries `along_mask(x, selections)` selects taken from `value` (broadcastable, cast to x's dtype)."""
    return torch.where(along_mask(x, selections), value.to(x.dtype), x)

"""Which entries of an activation an edit replaces: positions along `pos`, and units (heads, neurons) along one axis
(`selection_mask`), or any indices along any axes (`along_mask`: an attention pattern's heads, queries and keys).

Ablation (`lenskit.intervene.interventions`) and patching (`lenskit.intervene.patching`) both edit an activation
[batch, pos, ...] by `torch.where(mask, value, x)`; this module builds that mask, once.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch


def check_positions(positions: Sequence[int] | None, n_pos: int, what: str) -> None:
    """IndexError unless every position is in range for an input of `n_pos` positions (negatives count back)."""
    bad = [p for p in positions or () if not -n_pos <= p < n_pos]
    if bad:
        raise IndexError(f"{what} position {bad[0]} is out of range for an input of {n_pos} positions")


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

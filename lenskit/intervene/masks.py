"""Which entries of an activation an edit replaces: positions along `pos`, and units (heads, neurons) along one axis.

Ablation (`lenskit.intervene.interventions`) and patching (`lenskit.intervene.patching`) both edit an activation
[batch, pos, ...] by `torch.where(mask, value, x)`; this module builds that mask, once.
"""

from __future__ import annotations

from typing import Sequence

import torch


def check_positions(positions: Sequence[int] | None, n_pos: int, what: str) -> None:
    """IndexError unless every position is in range for an input of `n_pos` positions (negatives count back)."""
    bad = [p for p in positions or () if not -n_pos <= p < n_pos]
    if bad:
        raise IndexError(f"{what} position {bad[0]} is out of range for an input of {n_pos} positions")


def selection_mask(x: torch.Tensor, positions: Sequence[int] | None = None, axis: int | None = None,
                   units: Sequence[int] | None = None) -> torch.Tensor:
    """A bool mask that broadcasts against x [batch, pos, ...]: True at `positions` (all when None) and, with
    `axis`, at `units` along that axis (all when None). Empty lists select nothing."""
    # Built on the CPU and sent without waiting: indexing a GPU tensor with a Python list would stall the host.
    mask = torch.zeros(x.shape[1], dtype=torch.bool)
    mask[slice(None) if positions is None else list(positions)] = True
    shape = [1] * x.ndim
    shape[1] = x.shape[1]
    mask = mask.view(shape)  # [1, pos, 1, ...]
    if axis is not None and units is not None:
        chosen = torch.zeros(x.shape[axis], dtype=torch.bool)
        chosen[list(units)] = True
        unit_shape = [1] * x.ndim
        unit_shape[axis] = x.shape[axis]
        mask = mask & chosen.view(unit_shape)  # [1, pos, units, 1, ...]
    return mask.to(x.device, non_blocking=True)


def replace_where(x: torch.Tensor, value: torch.Tensor, positions: Sequence[int] | None = None, axis: int | None = None,
                  units: Sequence[int] | None = None) -> torch.Tensor:
    """x with the selected entries (see `selection_mask`) taken from `value` (broadcastable to x, cast to x's dtype)."""
    return torch.where(selection_mask(x, positions, axis, units), value.to(x.dtype), x)

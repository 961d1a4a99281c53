"""Slice: TransformerLens's selection along one axis, which an int index drops (as Python's does) and None leaves whole.

Every `pos_slice`, `batch_slice` and `neuron_slice` parameter in lenskit takes what `Slice` takes, or a `Slice`:

    None            the whole axis
    int             one index; the axis is dropped
    tuple           slice(*tuple): (k,) is [:k], (1, 5) is [1:5], (1, 5, 2) is [1:5:2]
    slice           itself
    list, tensor    those indices, in that order (a 1-d integer tensor or a boolean mask)

>>> Slice((1, 5, 2)).indices(8)
array([1, 3])
>>> Slice(-1).apply(torch.zeros(2, 7, 4), dim=1).shape
torch.Size([2, 4])
"""

from __future__ import annotations

import numbers
from typing import Sequence, Union

import numpy as np
import torch

__all__ = ["PosSlice", "Slice", "apply_slice"]

# What a slice parameter accepts: one of Slice's inputs, or a Slice.
PosSlice = Union[None, int, tuple, slice, Sequence[int], torch.Tensor, np.ndarray, "Slice"]


def as_int(value: object) -> int | None:
    """`value` as a Python int where it is an integer scalar (int, numpy integer, 0-d integer tensor or array),
    else None; a bool is not an index."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        kind = value.dtype
        integral = not (kind.is_floating_point or kind.is_complex or kind == torch.bool) if isinstance(value, torch.Tensor) \
            else np.issubdtype(kind, np.integer)
        return int(value.item()) if integral else None
    return None


class Slice:
    """One selection along an axis, with TransformerLens's interface: `Slice(input_slice)`, `.apply(tensor, dim)`,
    `.indices(max_ctx)`, `.mode` ("int", "slice", "array" or "identity") and `.slice` (what indexes the axis)."""

    slice: Union[int, slice, np.ndarray]
    mode: str

    def __init__(self, input_slice: PosSlice = None) -> None:
        if isinstance(input_slice, Slice):
            self.slice, self.mode = input_slice.slice, input_slice.mode
            return
        index = as_int(input_slice)
        if index is not None:
            self.slice, self.mode = index, "int"
        elif input_slice is None:
            self.slice, self.mode = slice(None), "identity"
        elif isinstance(input_slice, tuple):
            self.slice, self.mode = slice(*input_slice), "slice"
        elif isinstance(input_slice, slice):
            self.slice, self.mode = input_slice, "slice"
        elif isinstance(input_slice, (list, range, torch.Tensor, np.ndarray)):
            array = input_slice.detach().cpu().numpy() if isinstance(input_slice, torch.Tensor) else np.asarray(input_slice)
            if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_ or array.size == 0):
                raise TypeError(f"a Slice of positions is a 1-d list of ints or a boolean mask, got shape {array.shape} "
                                f"of {array.dtype}; pass e.g. [0, 3] or torch.tensor([0, 3])")
            self.slice, self.mode = array.astype(np.int64) if array.size == 0 else array, "array"
        else:
            raise TypeError(f"a slice is None, an int, a (start, stop[, step]) tuple, a slice, or a list / tensor of "
                            f"indices, got {type(input_slice).__name__} {input_slice!r:.60}")

    def apply(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """`tensor` with this selection along `dim` (negative counts from the end); an int drops the axis."""
        if self.mode == "identity":
            return tensor
        index: list = [slice(None)] * tensor.ndim
        index[dim] = torch.from_numpy(self.slice).to(tensor.device) if self.mode == "array" else self.slice
        return tensor[tuple(index)]

    def indices(self, max_ctx: int | None = None) -> np.ndarray:
        """The indices this selects from an axis of `max_ctx` entries, as a numpy array ([i] for an int)."""
        if self.mode == "int":
            return np.array([self.slice], dtype=np.int64)
        if max_ctx is None:
            raise ValueError(f"Slice({self.slice!r}).indices needs max_ctx, the length of the axis it selects from")
        return np.arange(max_ctx, dtype=np.int64)[self.slice]

    @classmethod
    def unwrap(cls, slice_input: PosSlice) -> "Slice":
        """`slice_input` as a Slice that keeps its axis: a bare int i becomes [i] (a Slice given is kept as is)."""
        if isinstance(slice_input, Slice):
            return slice_input
        index = as_int(slice_input)
        return cls([index] if index is not None else slice_input)

    def __repr__(self) -> str:
        return f"Slice({self.slice!r}, mode={self.mode!r})"


def apply_slice(x: torch.Tensor, pos_slice: PosSlice, dim: int) -> torch.Tensor:
    """`x` with `pos_slice` (anything `Slice` takes, or a Slice) applied along `dim`; an int drops the axis."""
    return Slice(pos_slice).apply(x, dim)

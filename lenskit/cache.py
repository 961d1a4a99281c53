"""ActivationCache: a read-only mapping from hook names to the tensors a forward pass produced."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Iterator

import torch

from .stream import POINTS, Stream, as_stream, block_hook_name, check_layer, streams

# Short names accepted by `cache[short, layer]` and where they live: the stream points, then the rest.
_BLOCK_SHORT = {
    **POINTS,
    "q": "attn.hook_q", "k": "attn.hook_k", "v": "attn.hook_v", "z": "attn.hook_z",
    "attn_scores": "attn.hook_attn_scores", "pattern": "attn.hook_pattern", "result": "attn.hook_result",
    "pre": "mlp.hook_pre", "post": "mlp.hook_post",
    "scale1": "ln1.hook_scale", "normalized1": "ln1.hook_normalized",
    "scale2": "ln2.hook_scale", "normalized2": "ln2.hook_normalized",
}


def hook_name(short: str, layer: int | None = None, n_layers: int | None = None) -> str:
    """Expand a short name: `hook_name("resid_post", 3) == "blocks.3.hook_resid_post"`.

    Layers are blocks; a negative layer counts back from n_layers (see `lenskit.stream.check_layer`).
    """
    if layer is None:
        return short
    if short not in _BLOCK_SHORT:
        raise KeyError(f"unknown short hook name {short!r}; known: {sorted(_BLOCK_SHORT)}")
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"a layer must be an int, got {layer!r}")
    if n_layers is not None:
        layer = check_layer(layer, n_layers)
    return block_hook_name(layer, _BLOCK_SHORT[short])


class ActivationCache(Mapping):
    """Activations keyed by hook name, plus `cache["resid_post", 3]` shorthand.

    Tensors are stored as produced (detached, never copied) unless a device or dtype was requested.
    """

    def __init__(self, store: dict[str, torch.Tensor], n_layers: int) -> None:
        self._store = store
        self.n_layers = n_layers

    def __getitem__(self, key: str | tuple[str, int] | Stream) -> torch.Tensor:
        if isinstance(key, Stream):
            return self.stream(key)
        name = hook_name(key[0], key[1], self.n_layers) if isinstance(key, tuple) else key
        try:
            return self._store[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self._store), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyError(f"{name!r} is not in this cache ({len(self._store)} entries){hint}") from None

    def __contains__(self, key: object) -> bool:
        try:
            self[key]  # type: ignore[index]
        except (KeyError, IndexError):  # an out-of-range layer is simply not here
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._store)

    def __len__(self) -> int:
        return len(self._store)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} tensors, n_layers={self.n_layers})"

    def stream(self, s: int | str | Stream) -> torch.Tensor:
        """The stream at `s` [batch, pos, d_model]: `cache.stream(3)` is the stream after 3 blocks,
        `cache.stream(Stream(3, "resid_mid"))` or `cache.stream("resid_mid.3")` the middle of block 3."""
        return self[as_stream(s).hook_name(self.n_layers)]

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> "ActivationCache":
        """A new cache with every tensor moved and/or cast."""
        return ActivationCache({k: v.to(device=device, dtype=dtype) for k, v in self._store.items()}, self.n_layers)

    def accumulated_resid(self, incl_mid: bool = False) -> torch.Tensor:
        """The residual stream after 0..n_layers blocks, stacked: [layer, batch, pos, d_model].

        Index l is `resid_pre` of block l; the last entry is the final block's `resid_post`.
        With `incl_mid`, each block's `resid_mid` is interleaved (2 * n_layers + 1 entries).
        """
        points = ("resid_pre", "resid_mid") if incl_mid else "resid_pre"
        names = [s.hook_name(self.n_layers) for s in streams(self.n_layers, points)]
        missing = [n for n in names if n not in self._store]
        if missing:
            raise KeyError(f"accumulated_resid needs {missing[:3]}{'...' if len(missing) > 3 else ''}; "
                           "run_with_cache without a names_filter, or include the resid hooks")
        return torch.stack([self._store[n] for n in names])

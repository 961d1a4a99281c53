"""`CacheRecording`: what `run_with_cache` attaches to every point it caches, and the activations it kept.

While it records (`recording()`), `HookPoint` hands other hooks a copy of any tensor it already holds, so an in-place
edit never rewrites an earlier entry. With a host `device`, activations on an accelerator are copied off it as they
are written (offload).
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import islice
from typing import Iterator

import torch
from torch import nn

from .hook_context import HookFn, hook_context  # hook points appear as nn.Module: lenskit.observe.hooks imports this


class CacheRecording:
    """The hook `run_with_cache` attaches to every point it caches, and the activations it kept (`store`).

    Activations are kept as the forward wrote them, detached and without a copy (moved or cast only where
    `device` / `dtype` ask), so one tensor can stand for two points: `resid_post` of block l is `resid_pre` of
    block l + 1, in rotary families `hook_embed` is block 0's `resid_pre`, and after a post-sublayer norm its
    `hook_normalized` is the `hook_attn_out` / `hook_mlp_out` write. While `recording()`, any other hook that
    is handed a tensor sharing memory with an entry gets a copy instead, so its in-place edits (`x[:, 3] = 0`,
    `x.zero_()`) reach that point and the ones after it, never an entry already kept.

    Until such a hook runs, recording costs no more than storing: the entries are looked at only when one is
    about to run (`holds`). The model's own code never edits a tensor in place after it passed a hook point,
    so an entry can change only while a hook runs; `check_unchanged()` then refuses an entry edited some other
    way than through the copy (a hook editing a tensor it kept from an earlier point), found by the entry's
    version counter (`t._version`, bumped by every in-place write).
    """

    def __init__(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        self.store: dict[str, torch.Tensor] = {}
        self._looked_at = 0  # how many entries `holds` has seen
        self._memory: set[int] = set()  # their data pointers
        self._versions: list[tuple[str, torch.Tensor, int]] = []  # (name, entry, version when first seen)
        self._in_flight: set[torch.device] = set()  # accelerators with copies to the host still queued
        store, in_flight = self.store, self._in_flight
        to_host = device is not None and torch.device(device).type == "cpu"
        if device is None and dtype is None:
            def record(x: torch.Tensor, hook: nn.Module) -> None:
                store[hook.name] = x.detach()
        else:
            def record(x: torch.Tensor, hook: nn.Module) -> None:  # integer entries (expert indices) keep their dtype
                x = x.detach().to(dtype=dtype if x.is_floating_point() else None)
                if to_host and x.is_cuda:
                    # Offload: a queued copy into pinned host memory, after any cast on the accelerator (only the
                    # kept bytes cross). The forward goes on without waiting; `synchronise` waits once at the end.
                    # A later in-place edit on the device is queued after the copy, so it never reaches the entry.
                    kept = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                    store[hook.name] = kept.copy_(x, non_blocking=True)
                    in_flight.add(x.device)
                else:
                    store[hook.name] = x.to(device=device)
        self.hook: HookFn = record

    def synchronise(self) -> None:
        """Wait for the copies to the host that the hook queued, once per accelerator, so that every entry holds
        its values; a no-op when nothing was offloaded."""
        while self._in_flight:
            torch.cuda.current_stream(self._in_flight.pop()).synchronize()

    def holds(self, x: torch.Tensor) -> bool:
        """Whether `x` shares memory with an entry. Entries kept since the last call are looked at first: their
        memory, and the version of each that spans its whole memory (a part of a buffer, such as hook_q of a
        fused projection, shares its counter with the rest, whose edits would read as its own)."""
        if len(self.store) > self._looked_at:
            for name, kept in islice(self.store.items(), self._looked_at, None):
                self._memory.add(kept.data_ptr())
                spans = kept.storage_offset() == 0 and kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()
                if spans and not kept.is_inference():  # inference tensors have no version counter
                    self._versions.append((name, kept, kept._version))
            self._looked_at = len(self.store)
        return x.data_ptr() in self._memory

    @contextmanager
    def recording(self) -> Iterator["CacheRecording"]:
        """Hand other hooks copies of the tensors kept here, for the body of a `with` block."""
        with hook_context(recording=(self.hook, self)):  # lenskit.observe.hook_context
            yield self

    def check_unchanged(self) -> None:
        """Refuse if an entry was edited in place after it was kept, so the cache never holds a later value."""
        for name, kept, version in self._versions:
            if kept._version != version:
                raise ValueError(f"{name} was edited in place after it was cached, by a hook that kept a reference to "
                                 "it, so the cache would not hold what the forward wrote there; edit a copy in the hook "
                                 "instead (x = x.clone(); x[...] = ...; return x)")

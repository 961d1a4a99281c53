"""Exporting activations of many windows to sharded safetensors (`lenskit cache`): resumable, and under torchrun.

The format and its reader are `lenskit.io.activations`. Shard k holds windows [k * W, (k + 1) * W), run through
the model `batch` windows at a time, so its bytes depend on k alone: not on the process count, nor on a kill.

Resuming: every shard is written to a temporary name and renamed into place, and the manifest is rewritten
(atomically) after each one, with the shard's checksum, so a run killed at any moment (Ctrl-C, SIGTERM, SIGHUP,
SIGUSR1 or SIGKILL) leaves whole shards and a manifest listing them. A rerun of the same export skips the shards
listed that pass verification (`shard_problem`: name, regular file in the folder, size, checksum, windows), writes
again those that fail (saying so in one line) and writes the rest; a folder holding another export (another
model, other hooks, dtype, windows, or format 1) is refused by name.

Distributed (torchrun, see `lenses.training.init_distributed`): rank r writes shards r, r + world, ... named
with its rank, and records them in `manifest-rank{r}.json`; rank 0 keeps `manifest.json`, and at the end lists
every rank's shards there and removes the others' records.

>>> from lenses.evaluation import heldout_windows
>>> windows = heldout_windows(stream, None, 256, model.cfg.n_ctx)     # [10, 256]
>>> manifest = export_activations(model, windows, "resid_post.5,resid_mid.3", "acts/", provenance=stream.provenance,
...                               progress=False)
>>> sorted(manifest["hooks"])
['blocks.3.hook_resid_mid', 'blocks.5.hook_resid_post']
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from tqdm import tqdm  # tqdm.auto warns in kernels without ipywidgets

from lenskit import HookedTransformer
from lenskit.io.activations import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    TOKENS,
    WINDOWS,
    dtype_name,
    file_checksum,
    read_manifest,
    resolve_hooks,
    shard_name,
    shard_problem,
)

from .io import write_atomic
from .training import distributed
from .training.lock import LOCK_FILE, locks_out_folder
from .tuned import model_fingerprint

# Shards of about this many bytes by default: large enough for fast sequential reads, small enough to resume.
SHARD_BYTES = 256 * 2**20
# What must match for a rerun to continue the export in a folder.
IDENTITY = ("format_version", "model_fingerprint", "hooks", "dtype", "ctx", "n_windows", "windows_per_shard",
            "tokens_sha256")


def rank_record(rank: int) -> str:
    return f"manifest-rank{rank}.json"


@locks_out_folder  # one export per folder: a second one refuses (lenses/training/lock.py)
@torch.no_grad()
def export_activations(model: HookedTransformer, windows: torch.Tensor, hooks: str | Sequence[str],
                       out: str | os.PathLike, *, provenance: dict | None = None, dtype: torch.dtype | None = None,
                       windows_per_shard: int | None = None, batch: int = 8, progress: bool = True) -> dict[str, Any]:
    """Write the activations of `hooks` for windows [n_windows, ctx] into `out` (see the module docstring) and
    return the manifest. `dtype` is the stored dtype (default the activations' own); `windows_per_shard`
    defaults to shards of about SHARD_BYTES. Under torch.distributed every rank calls this with the same
    windows; each computes and writes its own shards."""
    rank, world = distributed()
    out = Path(out)
    names = resolve_hooks(model, hooks)
    if windows.ndim != 2 or windows.shape[0] == 0:
        raise ValueError(f"windows must be [n_windows, ctx] with at least one window, got shape {tuple(windows.shape)}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1 window, got {batch}")
    windows = windows.to("cpu", torch.long).contiguous()
    ctx = windows.shape[1]
    model.validate_tokens(windows[:1])  # a window past n_ctx or an id past the vocabulary, refused before any work
    shapes, dtypes = _probe(model, windows[:1], names, dtype)
    floats = {d for d in dtypes.values() if d.is_floating_point}
    stored = floats.pop() if floats else torch.int64
    if windows_per_shard is None:
        per_window = ctx * (8 + sum(_numel(s) * dtypes[n].itemsize for n, s in shapes.items()))
        windows_per_shard = max(1, SHARD_BYTES // per_window)
    if windows_per_shard < 1:
        raise ValueError(f"windows_per_shard must be >= 1, got {windows_per_shard}")
    n_shards = -(-len(windows) // windows_per_shard)
    header = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "model_fingerprint": model_fingerprint(model),
        "model_name": model.cfg.name, "family": model.cfg.family, "n_layers": model.cfg.n_layers,
        "d_model": model.cfg.d_model, "hooks": names, "shapes": shapes, "dtype": dtype_name(stored),
        "dtypes": {n: dtype_name(d) for n, d in dtypes.items()}, "ctx": ctx,
        "n_windows": len(windows), "windows_per_shard": windows_per_shard, "n_shards": n_shards,
        "tokens_sha256": hashlib.sha256(windows.numpy().tobytes()).hexdigest(), "data": provenance or {},
    }
    done = _resume(out, header)  # every rank reads the folder before anyone writes to it
    if done and rank == 0:
        print(f"resuming the export in {out}: {len(done)} of {n_shards} shards done and verified", flush=True)
    if world > 1:
        dist.barrier()
    if rank == 0:
        _write_manifest(out, {**header, "shards": sorted(done.values(), key=_index), "complete": False})
        for part in out.glob("manifest-rank*.json"):  # what the ranks recorded is in manifest.json now
            part.unlink()
    if world > 1:
        dist.barrier()
    mine = [k for k in range(n_shards) if k % world == rank and k not in done]
    written: dict[int, dict] = {}
    device = model.embed.weight.device
    bar = tqdm(total=len(mine), desc=f"cache {len(done)}/{n_shards} done", unit="shard", dynamic_ncols=True,
               disable=not progress or rank != 0)
    try:
        for k in mine:
            first = k * windows_per_shard
            chunk = windows[first: first + windows_per_shard]
            tensors = _shard(model, chunk, names, batch, dtype, device)
            tensors[TOKENS] = chunk.clone()
            tensors[WINDOWS] = torch.arange(first, first + len(chunk), dtype=torch.long)
            path = out / shard_name(k, rank)
            # One metadata key: safetensors writes several in a random order, and a shard's bytes must be a
            # function of k alone (its index is in the `windows` tensor).
            write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": FORMAT}))
            for stale in out.glob(f"{shard_name(k, rank).split('-rank')[0]}-rank*.safetensors"):
                if stale != path:  # the same shard from a killed run of another process count, never listed
                    stale.unlink(missing_ok=True)
            written[k] = {"file": path.name, "index": k, "rank": rank, "first_window": first, "n_windows": len(chunk),
                          "bytes": path.stat().st_size, "checksum": file_checksum(path)}
            if rank == 0:
                _write_manifest(out, {**header, "shards": sorted([*done.values(), *written.values()], key=_index),
                                      "complete": False})
            else:
                _write_json(out / rank_record(rank), {"shards": sorted(written.values(), key=_index)})
            bar.update(1)
    finally:
        bar.close()
    if world > 1:
        dist.barrier()  # every rank's shards are written and recorded
    manifest = {**header, "shards": [], "complete": False}
    if rank == 0:
        every = {**done, **_recorded(out, header, read_manifest_too=False), **written}
        manifest = {**header, "shards": sorted(every.values(), key=_index), "complete": len(every) == n_shards}
        _write_manifest(out, manifest)
        for part in out.glob("manifest-rank*.json"):
            part.unlink()
    if world > 1:
        dist.barrier()
        if rank != 0:
            manifest = read_manifest(out)
    return manifest


def _index(record: dict) -> int:
    return record["index"]


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _probe(model: HookedTransformer, window: torch.Tensor, names: list[str],
           dtype: torch.dtype | None) -> tuple[dict[str, list[int]], dict[str, torch.dtype]]:
    """Each hook's per-token shape and stored dtype, from one window and the same cut by a token (so that a
    hook's second axis is seen to follow the position, whatever the head count); a hook that does not give one
    vector per (window, position) is refused by name. Integer hooks (expert indices) keep their dtype; the
    float ones are stored in `dtype`, or in their own when they share one."""
    device = model.embed.weight.device
    runs = [model.run_with_cache(w.to(device), names, return_logits=False, dtype=dtype, cache_device="cpu")[1]
            for w in ([window, window[:, :-1]] if window.shape[1] > 1 else [window])]
    shapes = {}
    for name in names:
        for w, cache in zip((window, window[:, :-1]), runs):
            t = cache[name]
            if t.ndim < 2 or tuple(t.shape[:2]) != tuple(w.shape):
                raise ValueError(f"{name} gives shape {tuple(t.shape)} for windows of {tuple(w.shape)}, not [batch, "
                                 "pos, ...]; export hooks with one vector per token")
        shapes[name] = list(runs[0][name].shape[2:])
    dtypes = {n: runs[0][n].dtype for n in names}
    floats = {d for d in dtypes.values() if d.is_floating_point}
    if len(floats) > 1:
        raise ValueError(f"the hooks give dtypes {sorted(map(str, floats))}; pass one dtype to store them in")
    return shapes, dtypes


def _shard(model: HookedTransformer, chunk: torch.Tensor, names: list[str], batch: int, dtype: torch.dtype | None,
           device: torch.device) -> dict[str, torch.Tensor]:
    """{hook: [window, pos, *shape]} for the windows of one shard, `batch` windows per forward, on the CPU."""
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for b in range(0, len(chunk), batch):
        _, cache = model.run_with_cache(chunk[b: b + batch].to(device), names, return_logits=False, dtype=dtype,
                                        cache_device="cpu")
        for n in names:
            parts[n].append(cache[n])
    return {n: torch.cat(ts).contiguous() for n, ts in parts.items()}  # cat copies: no two entries share memory


def _write_json(path: Path, value: dict) -> None:
    import json

    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8"))


def _write_manifest(out: Path, manifest: dict) -> None:
    _write_json(out / MANIFEST_FILE, manifest)


def _recorded(out: Path, header: dict, read_manifest_too: bool = True) -> dict[int, dict]:
    """Shards listed in the manifest and in the ranks' own records, by index, that pass verification (see
    `shard_problem`); those that fail are written again, and one line says which and why."""
    from lenskit.io.files import read_json_object

    records: list[dict] = list(read_manifest(out)["shards"]) if read_manifest_too else []
    for path in sorted(out.glob("manifest-rank*.json")):
        part = read_json_object(path, what="a rank's record of the shards it wrote")
        records += [s for s in part.get("shards", []) if isinstance(s, dict)]
    found, failed = {}, {}
    for s in records:
        if s.get("index") in found:
            continue  # the same shard recorded twice (by its rank, then in the manifest)
        problem = shard_problem(out, header, s) if isinstance(s.get("checksum"), str) else "it has no checksum"
        if problem is None:
            found[s["index"]] = s
        else:
            failed.setdefault(s.get("index"), (str(s.get("file")), problem))
    failed = {k: v for k, v in failed.items() if k not in found}  # a shard another record vouches for is done
    if failed and distributed()[0] == 0:
        first, why = next(iter(failed.values()))
        more = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
        print(f"{out}: {len(failed)} recorded shard(s) fail verification ({first}: {why}{more}); writing them again",
              flush=True)
    return found


def _resume(out: Path, header: dict) -> dict[int, dict]:
    """The shards already written by this same export in `out` ({} for a new or empty folder); a folder holding
    another export, or files but no manifest, is refused in one line naming what differs."""
    if not out.exists():
        return {}
    if not out.is_dir():
        raise NotADirectoryError(f"{out} is a file, not a folder; pass a folder as --out")
    if not (out / MANIFEST_FILE).exists():
        others = sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and p.name != LOCK_FILE)
        if others:
            raise ValueError(f"{out} holds files ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}) but no "
                             f"{MANIFEST_FILE}, so it is not an export to resume; pass a new or empty folder as --out")
        return {}
    saved = read_manifest(out)
    diffs = [f"{key} (saved {_short(saved.get(key))}, now {_short(header[key])})" for key in IDENTITY
             if saved.get(key) != header[key]]
    if diffs:
        raise ValueError(f"{out} holds another export: {'; '.join(diffs)} differ; pass another --out, or delete "
                         f"{out} to export into it again")
    return _recorded(out, header)


def _short(value: object) -> str:
    """A saved or current setting in a refusal: hook lists whole (up to 4 names), long strings cut."""
    if isinstance(value, list):
        more = f", +{len(value) - 4} more" if len(value) > 4 else ""
        return "[" + ", ".join(map(str, value[:4])) + more + "]"
    text = repr(value)
    return text if len(text) <= 40 else text[:36] + "...'"

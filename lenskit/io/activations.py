"""Exported activations on disk (`lenskit cache`): the format, the hook names it takes, and a reader.

A folder holds `manifest.json` and shards `shard-{index:05d}-rank{rank}.safetensors`. Shard k holds windows
k * windows_per_shard onwards (the last shard may hold fewer), whichever process wrote it:

- `tokens` [window, pos] int64, the token ids of its windows, and `windows` [window] int64, their indices;
- one tensor per exported hook, by its full name: [window, pos, *shape], e.g. [window, pos, d_model].

The manifest names the model (fingerprint, name, family), the hooks, the per-token `shapes`, the stored
`dtype` (of the float hooks) and each hook's own in `dtypes` (integer hooks, such as a MoE's expert indices,
stay int64), the window length `ctx`, the plan (`n_windows`, `windows_per_shard`, `n_shards`), the data's
provenance, and `shards`: one record per finished shard (`file`, `index`, `rank`, `first_window`,
`n_windows`, `bytes`, `checksum`). `complete` is true once every shard is written. See docs/activation_export.md.

The reader serves no row of a shard before the shard passes `shard_problem` (once per shard per reader): its
file is `shard_name(index, rank)`, a regular file in the folder (no link), of the recorded size and checksum,
whose `windows` tensor holds the windows the plan gives its index. Format 1 (no checksums) still reads, with
a warning, checked by everything but the checksum.

>>> from lenses.activation_export import export_activations        # `lenskit cache` writes the same folder
>>> manifest = export_activations(model, windows, "resid_post.5", "acts/", progress=False)   # windows [4, 64]
>>> rows = ActivationDataset("acts/", "resid_post.5")   # row i: window i // ctx, position i % ctx
>>> len(rows)
256
>>> activation, token = rows[0]                          # [d_model], int64 []
>>> activation.shape, token.dtype
(torch.Size([192]), torch.int64)
>>> loader = torch.utils.data.DataLoader(rows, batch_size=4096, shuffle=True)   # across shards
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
import stat
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.utils.data import Dataset, Subset

from ..observe.names import BLOCK_SHORT, HOOK_AXES, get_act_name, hook_layout, hook_name
from ..observe.stream import POINTS, Stream
from ..suggest import hook_hint
from .files import check_regular_file, read_json_object

if TYPE_CHECKING:
    from ..model import HookedTransformer

FORMAT = "lenskit-activations"
FORMAT_VERSION = 2  # 2: shard checksums, per-hook dtypes (1 is read, with a warning)
MANIFEST_FILE = "manifest.json"
TOKENS, WINDOWS = "tokens", "windows"  # the shard tensors beside the hooks'
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
          "int64": torch.int64, "int32": torch.int32}  # integers: a MoE's expert indices
_SHORT_LAYER = re.compile(r"^(?P<short>[a-z_0-9]+)[.:](?P<layer>-?\d+)$")


def shard_name(index: int, rank: int) -> str:
    """The file name of shard `index` written by process `rank`."""
    return f"shard-{index:05d}-rank{rank}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------ hook names
def resolve_hook(n_layers: int, hook_dict: dict, spec: str) -> str:
    """The full hook name for `spec`: a full name ("blocks.6.hook_resid_post"), short.layer ("resid_post.6",
    "mlp_out.-1", "pre.3"; "resid_pre.{n_layers}" is the last stream) or TransformerLens's short forms ("k6").
    An unknown name is refused by name (KeyError, with close matches), as is a hook without one vector per token."""
    spec = spec.strip()
    name = spec
    if spec not in hook_dict:
        short = _SHORT_LAYER.match(spec)
        try:
            if short and short["short"] in POINTS:
                name = Stream.parse(spec).hook_name(n_layers)
            elif short and short["short"] in BLOCK_SHORT:
                name = hook_name(short["short"], int(short["layer"]), n_layers)
            else:
                name = get_act_name(spec)
        except IndexError as e:  # a layer past the model
            raise KeyError(f"hook {spec!r}: {e}") from None
        except (KeyError, ValueError):
            name = spec
    if name not in hook_dict:
        raise KeyError(f"unknown hook name {spec!r}{hook_hint(spec, hook_dict)}")
    layout = hook_layout(name)
    if layout != "per-token":
        raise ValueError(f"{name} is not one vector per token (it is {layout}: {' '.join(HOOK_AXES[layout])}), so it "
                         "cannot be exported as rows; export per-token hooks such as resid_post.L, attn_out.L or z.L")
    return name


def resolve_hooks(model: "HookedTransformer", specs: str | Sequence[str]) -> list[str]:
    """Full hook names for a comma-separated list or a sequence of specs (see `resolve_hook`), duplicates dropped."""
    if isinstance(specs, str):
        specs = specs.split(",")
    names = [resolve_hook(model.cfg.n_layers, model.hook_dict, s) for s in specs if s.strip()]
    if not names:
        raise ValueError("no hooks given; pass hook names such as resid_post.6,resid_mid.12")
    return list(dict.fromkeys(names))


# ------------------------------------------------------------------ the manifest
def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


MANIFEST_FIELDS = {
    "format": (lambda v: v == FORMAT, f"{FORMAT!r}"),
    "format_version": (lambda v: v in (1, FORMAT_VERSION), f"1 or {FORMAT_VERSION}"),
    "model_fingerprint": (lambda v: isinstance(v, str), "the model's fingerprint, a string"),
    "hooks": (lambda v: isinstance(v, list) and v and all(isinstance(x, str) for x in v), "a list of hook names"),
    "shapes": (lambda v: isinstance(v, dict) and all(isinstance(s, list) and all(_count(d) for d in s) for s in v.values()),
               "per-token shapes, {hook: [sizes]}"),
    "dtype": (lambda v: v in DTYPES, f"one of {', '.join(DTYPES)}"),
    "ctx": (lambda v: _count(v) and v >= 1, "the window length, an integer >= 1"),
    "n_windows": (_count, "the number of windows, an integer >= 0"),
    "windows_per_shard": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
    "n_shards": (_count, "the number of shards, an integer >= 0"),
    "shards": (lambda v: isinstance(v, list) and all(isinstance(s, dict) and isinstance(s.get("file"), str)
                                                     and _count(s.get("index")) and _count(s.get("n_windows"))
                                                     and _count(s.get("first_window")) for s in v),
               "a list of shard records {file, index, rank, first_window, n_windows, bytes}"),
}


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of an export folder, every field checked (ValueError naming the file and the field)."""
    path = Path(folder) / MANIFEST_FILE
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no {MANIFEST_FILE} in {folder}; expected a folder written by `lenskit cache`")
    manifest = read_json_object(path, what="an activation-export manifest")
    for key, (ok, want) in MANIFEST_FIELDS.items():
        if key not in manifest or not ok(manifest[key]):
            found = "missing" if key not in manifest else f"{manifest[key]!r:.60}"
            raise ValueError(f"{path}: field {key!r} must be {want}, found {found}; the export is corrupt: "
                             "export again into a new folder")
    missing = set(manifest["hooks"]) - set(manifest["shapes"])
    if missing:
        raise ValueError(f"{path}: 'shapes' has no entry for {sorted(missing)}; the export is corrupt: export again")
    if manifest["format_version"] >= 2:
        dtypes, sums = manifest.get("dtypes"), [s.get("checksum") for s in manifest["shards"]]
        if not isinstance(dtypes, dict) or set(dtypes) != set(manifest["hooks"]) or not set(dtypes.values()) <= set(DTYPES):
            raise ValueError(f"{path}: field 'dtypes' must give each hook's dtype (one of {', '.join(DTYPES)}), found "
                             f"{dtypes!r:.60}; the export is corrupt: export again")
        if not all(isinstance(c, str) and c.startswith(CHECKSUM + ":") for c in sums):
            raise ValueError(f"{path}: a shard record has no {CHECKSUM} checksum; the export is corrupt: export again")
    return manifest


def hook_dtype(manifest: dict, hook: str) -> torch.dtype:
    """The stored dtype of `hook` in an export (format 1 stored every hook in `dtype`)."""
    return DTYPES[manifest.get("dtypes", {}).get(hook, manifest["dtype"])]


# ------------------------------------------------------------------ verifying a shard
CHECKSUM = "sha256"  # of the whole file: as `sha256sum` gives it, and the fastest hashlib has on CPUs with SHA instructions


def file_checksum(path: str | os.PathLike) -> str:
    """"sha256:<hex>" of the file's bytes, read in 16 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 24):
            digest.update(piece)
    return f"{CHECKSUM}:{digest.hexdigest()}"


def shard_problem(folder: str | os.PathLike, manifest: dict, record: dict, checksum: bool = True) -> str | None:
    """Why shard `record` of the export planned by `manifest` in `folder` cannot be served, or None when it can:
    its index and windows must be the plan's, its file `shard_name(index, rank)` a regular file in `folder` (not
    a link), of the recorded size and checksum (where the record has one), holding the `windows` it should."""
    k, W = record.get("index"), manifest["windows_per_shard"]
    if not _count(k) or k >= manifest["n_shards"]:
        return f"its index {k!r} is not one of the plan's {manifest['n_shards']} shards"
    first = k * W
    n = min(W, manifest["n_windows"] - first)
    if (record.get("first_window"), record.get("n_windows")) != (first, n):
        return (f"it says windows {record.get('first_window')!r} + {record.get('n_windows')!r}, where shard {k} holds "
                f"windows {first} + {n}")
    rank = record.get("rank")
    if not _count(rank) or record.get("file") != shard_name(k, rank):
        return f"its file {record.get('file')!r} is not {shard_name(k, rank if _count(rank) else 0)!r}"
    path = Path(folder) / record["file"]
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "its file is missing"
    if not stat.S_ISREG(st.st_mode):
        return "its file is not a regular file (a link, folder or device)"
    if st.st_size != record.get("bytes"):
        return f"its file has {st.st_size} bytes, the record {record.get('bytes')!r}"
    if checksum and "checksum" in record and file_checksum(path) != record["checksum"]:
        return "its checksum differs from the record's (the file changed)"
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            stored = f.get_tensor(WINDOWS)
    except Exception as e:  # noqa: BLE001 - safetensors' own error types for a cut or foreign file
        return f"it is not a readable shard ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'unreadable'})"
    if not torch.equal(stored, torch.arange(first, first + n, dtype=stored.dtype)) or stored.dtype != torch.long:
        return f"its windows tensor is not windows {first}..{first + n - 1}"
    return None


# ------------------------------------------------------------------ the reader
class ActivationDataset(Dataset):
    """The per-token rows of one exported hook: `rows[i] == (activation [*shape], token id [] int64)`, row i
    being window i // ctx, position i % ctx (windows in order), read from memory-mapped shards.

    Each shard is opened with safetensors' `safe_open` on first use (in each DataLoader worker), and a row is
    a view of the mapped file, so memory holds only the pages read. `DataLoader(rows, shuffle=True)` shuffles
    across shards; `rows.shuffled(seed)` is a fixed order. A folder whose export is unfinished is refused
    unless `allow_incomplete=True` (then the rows are those of the shards written, in window order).
    """

    def __init__(self, folder: str | os.PathLike, hook: str | None = None, *, allow_incomplete: bool = False) -> None:
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        m = self.manifest
        hooks = m["hooks"]
        if hook is None:
            if len(hooks) != 1:
                raise ValueError(f"{folder} holds {len(hooks)} hooks ({', '.join(hooks)}); name the one to read")
            hook = hooks[0]
        n_layers = m.get("n_layers")
        by_name = dict.fromkeys(hooks)
        try:
            self.hook = hook if hook in by_name else resolve_hook(n_layers if isinstance(n_layers, int) else 0, by_name, hook)
        except (KeyError, ValueError):
            raise KeyError(f"{folder} holds no hook {hook!r}; it holds {', '.join(hooks)}") from None
        self.shape = tuple(m["shapes"][self.hook])
        self.dtype = hook_dtype(m, self.hook)
        self.ctx = m["ctx"]
        shards = sorted(m["shards"], key=lambda s: s["index"])
        twice = [a["index"] for a, b in zip(shards, shards[1:]) if a["index"] == b["index"]]
        if twice:
            raise ValueError(f"{folder}: two shard records name shard {twice[0]}, so its rows would be read twice; the "
                             "export is corrupt: rerun the same `lenskit cache` command to rewrite its records")
        if m["format_version"] < 2:
            warnings.warn(f"{folder} was exported in activation format {m['format_version']}, whose records have no "
                          "checksums: its shards are checked by name, size and windows only; export again into a new "
                          "folder to have them checksummed", UserWarning, stacklevel=2)
        self.complete = bool(m.get("complete")) and len(shards) == m["n_shards"]
        if not self.complete and not allow_incomplete:
            raise ValueError(f"the export in {folder} is unfinished ({len(shards)} of {m['n_shards']} shards); rerun the "
                             "same `lenskit cache` command to finish it, or pass allow_incomplete=True")
        self.shards = shards
        self._starts = []  # first row of each shard
        total = 0
        for s in shards:
            self._starts.append(total)
            total += s["n_windows"] * self.ctx
        self._rows = total
        self._open: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self._rows

    def _shard(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Shard k's (activations [window * pos, *shape], tokens [window * pos]), mapped on first use."""
        if k not in self._open:
            from safetensors import safe_open

            record = self.shards[k]
            path = self.folder / record["file"]
            problem = shard_problem(self.folder, self.manifest, record)
            if problem is not None:
                raise ValueError(f"{path}: shard {record['index']} fails verification: {problem}; its rows are not "
                                 "served: rerun the same `lenskit cache` command to write it again")
            check_regular_file(path, "an activation shard (safetensors)")
            with safe_open(str(path), framework="pt", device="cpu") as f:
                acts, tokens = f.get_tensor(self.hook), f.get_tensor(TOKENS)
            want = (record["n_windows"], self.ctx, *self.shape)
            if tuple(acts.shape) != want or acts.dtype != self.dtype or tuple(tokens.shape) != want[:2]:
                raise ValueError(f"{path} holds {self.hook} of shape {tuple(acts.shape)} {acts.dtype}, expected {want} "
                                 f"{self.dtype} (the manifest's); the export is corrupt: export again")
            self._open[k] = acts.reshape(-1, *self.shape), tokens.reshape(-1)
        return self._open[k]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i < 0:
            i += self._rows
        if not 0 <= i < self._rows:
            raise IndexError(f"row {i} is out of range for {self._rows} rows")
        k = bisect.bisect_right(self._starts, i) - 1
        acts, tokens = self._shard(k)
        r = i - self._starts[k]
        return acts[r], tokens[r]

    def window(self, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window `w` (by its place among the windows read) whole: (activations [pos, *shape], tokens [pos])."""
        n = self._rows // self.ctx
        if not -n <= w < n:
            raise IndexError(f"window {w} is out of range for {n} windows")
        rows = slice((w % n) * self.ctx, (w % n + 1) * self.ctx)
        k = bisect.bisect_right(self._starts, rows.start) - 1
        acts, tokens = self._shard(k)
        r = rows.start - self._starts[k]
        return acts[r: r + self.ctx], tokens[r: r + self.ctx]

    def shuffled(self, seed: int) -> Subset:
        """The rows in an order fixed by `seed` (a permutation of every row, across shards)."""
        return Subset(self, torch.randperm(self._rows, generator=torch.Generator().manual_seed(seed)).tolist())

    def __getstate__(self) -> dict:  # DataLoader workers map their own shards
        return {**self.__dict__, "_open": {}}

    def __repr__(self) -> str:
        return f"ActivationDataset({str(self.folder)!r}, {self.hook!r}: {self._rows:,} rows of {list(self.shape)} {dtype_name(self.dtype)})"

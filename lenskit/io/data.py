"""Token data: text files, folders and JSONL read into one token stream, cut into fixed windows.

Everything here is a pure function of the inputs, so a training run can name its data exactly
(`TokenStream.provenance`: every file's path, size and sha256) and pick its batches as a function
of (seed, step) alone, which is what lets a killed run resume bit-for-bit.

>>> stream = load_token_stream([stdlib_root() / "copy.py", stdlib_root() / "json"], model.tokenizer)   # files, folders
>>> len(stream) == stream.provenance["n_tokens"]
True
>>> windows = stream.windows(256)            # [n_windows, 256], non-overlapping, in stream order
>>> torch.equal(windows[0], stream.tokens[:256])
True
>>> order = window_order(len(windows), seed=0)
>>> torch.equal(order.sort().values, torch.arange(len(windows)))   # a permutation, the same for the same seed
True
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from .files import FOLDER, REGULAR_FILE, NotARegularFileError, path_kind, read_bytes
from .tokenizer import tokenizer_failures

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Inside a folder, these are read as text (a file given by name is read whatever its suffix).
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".text")
# The embedded model's split of the standard library: one file in HELDOUT_BUCKETS, by a hash of its path, is held out.
HELDOUT_BUCKETS = 20
# Held-out modules of that split present in every Python from 3.10 to 3.13: default reference text.
HELDOUT_SAMPLE = ("copy.py", "base64.py", "gzip.py", "enum.py")


@dataclass(frozen=True)
class Document:
    source: str  # file path, or "path:line" for a JSONL record
    text: str


@dataclass
class TokenStream:
    """Documents tokenized and joined, each followed by the end-of-text token.

    `n_bytes` counts the UTF-8 bytes of the texts (for bits per byte); `provenance` names every file read.
    """

    tokens: torch.Tensor  # [n_tokens] int64
    n_bytes: int
    provenance: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def bytes_per_token(self) -> float:
        return self.n_bytes / max(1, len(self.tokens))

    def windows(self, ctx: int) -> torch.Tensor:
        """Non-overlapping windows [n_windows, ctx] in stream order; the tail shorter than ctx is dropped."""
        if ctx < 2:
            raise ValueError(f"a window needs at least 2 tokens, got ctx={ctx}")
        n = len(self.tokens) // ctx
        if n == 0:
            raise ValueError(f"the data has {len(self.tokens)} tokens, fewer than one window of {ctx}; add more text")
        return self.tokens[: n * ctx].view(n, ctx)


def window_order(n_windows: int, seed: int) -> torch.Tensor:
    """A permutation of range(n_windows) that depends only on (n_windows, seed), on any machine."""
    return torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def list_files(paths: Sequence[str | Path]) -> list[Path]:
    """Expand the inputs: a file is itself; a folder is every text file below it (TEXT_SUFFIXES and
    .jsonl, hidden entries skipped) in sorted order of the relative path. A path that is neither a regular
    file nor a folder (a FIFO, a socket, a device), given or found in a folder, is refused by name: reading
    it could block forever."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        kind = path_kind(p)
        if kind == REGULAR_FILE:
            files.append(p)
        elif kind == FOLDER:
            found = sorted(
                (f for f in p.rglob("*") if f.suffix.lower() in (*TEXT_SUFFIXES, ".jsonl") and path_kind(f) not in (FOLDER, None)
                 and not any(part.startswith(".") for part in f.relative_to(p).parts)),
                key=lambda f: f.relative_to(p).as_posix(),
            )
            for f in found:
                if path_kind(f) != REGULAR_FILE:
                    raise NotARegularFileError(f"data file {f} is not a regular file but {path_kind(f)}; remove it "
                                               f"from {p}, or pass regular text files")
            if not found:
                raise FileNotFoundError(f"folder {p} holds no text files (looked for {', '.join(TEXT_SUFFIXES)}, .jsonl)")
            files.extend(found)
        elif kind is None:
            raise FileNotFoundError(f"data path {p} does not exist; pass text files, folders or .jsonl files")
        else:
            raise NotARegularFileError(f"data path {p} is not a regular file but {kind}; pass text files, folders "
                                       "or .jsonl files")
    if not files:
        raise ValueError("no data paths given; pass at least one text file, folder or .jsonl file")
    return files


def decode_text(path: Path, raw: bytes, max_bad_fraction: float = 0.01) -> str:
    """UTF-8 text of a file. A few undecodable bytes become U+FFFD, with a warning that counts them; a file with
    NUL bytes or more than `max_bad_fraction` undecodable ones is binary and refused (ValueError naming it)."""
    has_nul = b"\x00" in raw
    try:
        if not has_nul:
            return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if has_nul or bad > max_bad_fraction * len(raw):
        nul = ", and NUL bytes" if has_nul else ""
        raise ValueError(f"{path} is not UTF-8 text ({bad:,} of {len(raw):,} bytes undecodable{nul}); "
                         "it looks binary: remove it from the data")
    warnings.warn(f"{path}: {bad:,} bytes are not UTF-8 and were read as U+FFFD", stacklevel=3)
    return text


def read_documents(paths: Sequence[str | Path], text_field: str = "text") -> tuple[list[Document], dict]:
    """Read every file (see `list_files`) into documents; JSONL gives one document per record's `text_field`.

    Returns the documents and the provenance: each file's path (`portable_path`), size and sha256, plus one
    sha256 over all of them in order, which identifies the data as a whole, wherever it lies.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    docs: list[Document] = []
    records = []
    for f, recorded in ((f, portable_path(f, given)) for given in paths for f in list_files([given])):
        raw = read_bytes(f, what="a text or .jsonl data file")
        records.append({"path": recorded, "bytes": len(raw), "sha256": _sha256(raw)})
        if f.suffix.lower() == ".jsonl":
            for i, line in enumerate(decode_text(f, raw).splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{f}:{i} is not valid JSON ({e.msg}); expected one JSON object per line") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                    raise ValueError(f"{f}:{i} has no string field {text_field!r}; expected records like "
                                     f'{{"{text_field}": "..."}}')
                docs.append(Document(f"{f.as_posix()}:{i}", obj[text_field]))
        else:
            docs.append(Document(f.as_posix(), decode_text(f, raw)))
    combined = _sha256("\n".join(f"{r['path']} {r['sha256']}" for r in records).encode())
    provenance = {
        "inputs": [portable_path(Path(p), p) for p in paths],
        "n_files": len(records),
        "bytes": sum(r["bytes"] for r in records),
        "sha256": combined,
        "files": records,
    }
    return docs, provenance


def portable_path(f: Path, given: str | Path) -> str:
    """How provenance names file `f`, found under the input `given`, with no absolute path of this machine: a
    relative input as given, an absolute one by its path from the working directory when it is below it, else by
    its own name; a file in a folder as that name plus its path inside the folder."""
    given = Path(given).expanduser()
    label = given
    if given.is_absolute():
        try:
            label = given.resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            label = Path(given.name)
    inside = Path(f).relative_to(given) if Path(f) != given else Path()
    return (label / inside).as_posix()


def eos_id(tokenizer: "PreTrainedTokenizerBase") -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no end-of-text token to separate documents; set tokenizer.eos_token")
    return int(eos)


def tokenize_documents(docs: Iterable[Document], tokenizer: "PreTrainedTokenizerBase", batch: int = 256) -> torch.Tensor:
    """Token ids [n_tokens] of all documents, each followed by the end-of-text token."""
    eos = eos_id(tokenizer)
    docs = list(docs)
    ids: list[int] = []
    for i in range(0, len(docs), batch):
        with tokenizer_failures(tokenizer, f"encoding {docs[i].source} (and the {min(batch, len(docs) - i) - 1} documents after it)"):
            rows = tokenizer([d.text for d in docs[i: i + batch]], add_special_tokens=False)["input_ids"]
        for row in rows:
            ids.extend(row)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def load_token_stream(paths: Sequence[str | Path], tokenizer: "PreTrainedTokenizerBase", text_field: str = "text") -> TokenStream:
    """Read, tokenize and join: the whole data pipeline from paths to one stream with its provenance."""
    docs, provenance = read_documents(paths, text_field)
    tokens = tokenize_documents(docs, tokenizer)
    n_bytes = sum(len(d.text.encode("utf-8")) for d in docs)
    provenance = {**provenance, "n_documents": len(docs), "n_tokens": len(tokens), "text_bytes": n_bytes}
    return TokenStream(tokens, n_bytes, provenance)


# ------------------------------------------------------------------ the embedded model's split
def reference_windows(tokenizer: "PreTrainedTokenizerBase", paths: Sequence[str | Path] | None, length: int, seed: int,
                      n_windows: int = 32) -> torch.Tensor:
    """[n_windows or fewer, length] token windows of reference text (for mean or resample ablation) in a seeded
    order; `paths=None` reads `HELDOUT_SAMPLE`, held-out standard-library modules the embedded model never saw."""
    if paths is None:
        root = stdlib_root()
        paths = [str(root / name) for name in HELDOUT_SAMPLE if (root / name).is_file()]
        if not paths:
            raise FileNotFoundError(f"none of the default reference modules {HELDOUT_SAMPLE} is in {root}; "
                                    "pass --reference with some text")
    windows = load_token_stream(paths, tokenizer).windows(length)
    return windows[window_order(len(windows), seed)[:n_windows]]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, path) of every .py file in the running Python's standard library, site-packages excluded, sorted."""
    root = stdlib_root()
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")) or "/site-packages/" in rel:
            continue
        files.append((rel, p))
    return files


def is_heldout(rel: str) -> bool:
    """Whether the standard-library file at relative path `rel` is in the embedded model's held-out split:
    `sha1(rel) % HELDOUT_BUCKETS == 0`, one file in twenty, decided by the path alone."""
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELDOUT_BUCKETS == 0

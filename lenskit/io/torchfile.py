"""Reading a `torch.save` file from someone else (a tuned-lens `params.pt`, a reference Jacobian lens `.pt`)
without trusting it: `read_plain_torch_file`.

`torch.load(weights_only=True)` already refuses pickled objects, but it inflates whatever the zip holds: a
1 MB file whose DEFLATE entry claims 1 GB costs 1 GB before anything is checked. `torch.save` itself only
ever writes STORED (uncompressed) entries, one `data/<key>` record per tensor storage, so that is all this
reader accepts. The zip's central directory and local headers are read with `zipfile` (nothing is
inflated), the pickle is scanned opcode by opcode with `pickletools` (nothing is executed) for the storages
it declares, and every record must be exactly as long as its storage: memory is bounded by the file's size.
Only then does `torch.load(weights_only=True)` run.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import struct
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .files import open_regular

# The pickle is the file's table of contents: a few hundred bytes per tensor.
PICKLE_MAX_BYTES = 64 << 20
# signature, version needed, flags, method, time, date, crc32, sizes (compressed, not), name and extra lengths
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_MARK = object()


class TorchFileError(ValueError):
    """A `.pt` file that is not a plain, uncompressed `torch.save` file of tensors."""


class _Opaque:
    """A value the scan does not need to know (a dict, a rebuilt tensor, an object)."""


_OPAQUE = _Opaque()


def read_plain_torch_file(path: str | os.PathLike, what: str = "a PyTorch tensor file (torch.save of tensors)") -> Any:
    """What `torch.load(path, map_location="cpu", weights_only=True)` returns (typically a dict of tensors),
    for a zip-format `torch.save` file whose every entry is STORED and every `data/<key>` record exactly as
    long as the storage the pickle declares for it. Anything else is refused before a byte is inflated or a
    pickled object is built: one-line TorchFileError (a ValueError) naming the file and what is wrong.
    Memory is bounded by the file's size.

    >>> torch.save({"layer_norm.bias": torch.zeros(2)}, "params.pt")   # as the tuned-lens package saves a lens
    >>> read_plain_torch_file("params.pt")
    {'layer_norm.bias': tensor([0., 0.])}
    """
    path = Path(path)
    # One open file for the checks and the load: the path cannot be swapped for another file in between.
    with open_regular(path, what) as (fd, st), os.fdopen(os.dup(fd), "rb") as f:
        _check_archive(path, f, st.st_size)
        f.seek(0)
        return _load(path, f)


def _load(path: Path, f: BinaryIO) -> Any:
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise TorchFileError(f"{path} is not a plain tensor file: it holds pickled Python objects, which lenskit "
                             "refuses to load: nothing in it was executed; re-save the tensors alone "
                             "(torch.save of a dict of tensors)") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, AssertionError) as e:
        raise TorchFileError(f"{path} is not a readable PyTorch tensor file (truncated or corrupt?): "
                             f"{_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


def _check_archive(path: Path, raw: BinaryIO, file_size: int) -> dict[str, int]:
    """The zip checks: every entry STORED and inside the file, one pickle, and records that match it.
    Returns storage key -> bytes."""
    def refuse(why: str) -> TorchFileError:
        return TorchFileError(f"{path} is not a plain torch.save file: {why}; lenskit reads only uncompressed "
                              "torch.save output: re-save it with torch.save")

    try:
        with zipfile.ZipFile(raw) as zf:  # reads the central directory only
            infos = zf.infolist()
            names = [i.filename for i in infos]
            if len(set(names)) != len(names):
                raise refuse("the zip names an entry twice")
            spans = []
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED:
                    kinds = {zipfile.ZIP_DEFLATED: "DEFLATE", zipfile.ZIP_BZIP2: "BZIP2", zipfile.ZIP_LZMA: "LZMA"}
                    raise refuse(f"entry {info.filename} is {kinds.get(info.compress_type, 'compressed')}-compressed "
                                 f"({info.compress_size:,} bytes claiming {info.file_size:,}), and is not inflated")
                if info.flag_bits & 0x1:
                    raise refuse(f"entry {info.filename} is encrypted")
                if info.compress_size != info.file_size:
                    raise refuse(f"entry {info.filename} is stored as {info.compress_size:,} bytes but claims {info.file_size:,}")
                raw.seek(info.header_offset)
                header = raw.read(_LOCAL_HEADER.size)
                if len(header) != _LOCAL_HEADER.size:
                    raise refuse(f"entry {info.filename} has no local header where the directory says")
                signature, method, name_len, extra_len = (_LOCAL_HEADER.unpack(header)[i] for i in (0, 3, 9, 10))
                if signature != b"PK\x03\x04":
                    raise refuse(f"entry {info.filename} has no local header where the directory says")
                if method != zipfile.ZIP_STORED:
                    raise refuse(f"entry {info.filename} is compressed in its local header")
                end = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len + info.file_size
                if end > file_size:
                    raise refuse(f"entry {info.filename} claims {info.file_size:,} bytes past the end of the file")
                spans.append((info.header_offset, end, info.filename))
            spans.sort()
            for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
                if start < end:  # entries that share bytes: the same data read (and allocated) again and again
                    raise refuse(f"entries {name} and {other} overlap")
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            if len(pickles) != 1:
                raise refuse(f"expected one <archive>/data.pkl entry, found {len(pickles)}")
            if pickles[0].file_size > PICKLE_MAX_BYTES:
                raise refuse(f"its pickle is {pickles[0].file_size:,} bytes, more than {PICKLE_MAX_BYTES:,}")
            prefix = pickles[0].filename[: -len("data.pkl")]
            storages = _declared_storages(zf.read(pickles[0]), refuse)
            records = {i.filename[len(prefix) + len("data/"):]: i.file_size for i in infos
                       if i.filename.startswith(f"{prefix}data/")}
    except zipfile.BadZipFile as e:
        raw.seek(0)
        head = raw.read(1)
        legacy = " (it looks like the legacy pre-1.6 torch.save format)" if head == b"\x80" else ""
        raise TorchFileError(f"{path} is not a zip-format torch.save file{legacy} ({_first_line(e)}); "
                             "re-save it with torch.save from PyTorch 1.6 or later") from None
    except (zipfile.LargeZipFile, EOFError, struct.error, NotImplementedError, OSError) as e:
        raise refuse(f"its zip cannot be read ({type(e).__name__}: {_first_line(e)})") from None
    for key, nbytes in storages.items():
        if key not in records:
            raise refuse(f"the pickle declares storage {key!r} but there is no data/{key} entry")
        if records[key] != nbytes:
            raise refuse(f"data/{key} holds {records[key]:,} bytes but the pickle declares a storage of {nbytes:,}")
    unused = sorted(set(records) - set(storages))
    if unused:
        raise refuse(f"data/{unused[0]} is not a storage the pickle declares")
    return storages


def _storage_itemsize(storage_type: object) -> int | None:
    """Bytes per element of a storage class named in a pickle (`torch FloatStorage`, `torch.storage UntypedStorage`)."""
    if not (isinstance(storage_type, tuple) and len(storage_type) == 2):
        return None
    module, name = storage_type
    if (module, name) in (("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage")):
        return 1
    if module != "torch" or not name.endswith("Storage"):
        return None
    try:
        return torch.serialization.StorageType(name).dtype.itemsize
    except (KeyError, AttributeError):
        return None


def _declared_storages(pickle_bytes: bytes, refuse) -> dict[str, int]:
    """Storage key -> bytes, for every persistent id ('storage', <storage class>, key, location, numel) the
    pickle loads. A stack machine over the opcodes that tracks only constants, tuples and globals; every
    other value is opaque, and nothing is built, imported or called."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    storages: dict[str, int] = {}

    def pop_mark() -> list[Any]:
        items = []
        while stack:
            top = stack.pop()
            if top is _MARK:
                return items[::-1]
            items.append(top)
        raise refuse("its pickle is malformed (no MARK)")

    def top() -> Any:
        if not stack:
            raise refuse("its pickle is malformed (stack underflow)")
        return stack[-1]

    def pop(n: int = 1) -> list[Any]:
        if len(stack) < n:
            raise refuse("its pickle is malformed (stack underflow)")
        items = stack[-n:]
        del stack[-n:]
        return items

    constants = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}
    try:
        for op, arg, _ in pickletools.genops(pickle_bytes):
            name = op.name
            if name in ("PROTO", "FRAME"):
                continue
            if name == "STOP":
                break
            if name == "MARK":
                stack.append(_MARK)
            elif name in constants:
                stack.append(constants[name])
            elif name in ("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
                          "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE",
                          "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8"):
                stack.append(arg)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                stack.append(tuple(pop(int(name[-1]))))
            elif name == "TUPLE":
                stack.append(tuple(pop_mark()))
            elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"):
                stack.append(_OPAQUE)
            elif name in ("LIST", "DICT", "FROZENSET", "OBJ", "INST"):
                pop_mark()
                stack.append(_OPAQUE)
            elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
                pop_mark()
            elif name in ("APPEND", "BUILD"):
                pop(1)
            elif name == "SETITEM":
                pop(2)
            elif name == "GLOBAL":
                module, _, attr = arg.partition(" ")
                stack.append((module, attr))
            elif name == "STACK_GLOBAL":
                module, attr = pop(2)
                stack.append((module, attr))
            elif name in ("REDUCE", "NEWOBJ"):
                pop(2)
                stack.append(_OPAQUE)
            elif name == "NEWOBJ_EX":
                pop(3)
                stack.append(_OPAQUE)
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = top()
            elif name == "MEMOIZE":
                memo[len(memo)] = top()
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                if arg not in memo:
                    raise refuse("its pickle is malformed (GET of an unknown memo entry)")
                stack.append(memo[arg])
            elif name == "BINPERSID":
                (pid,) = pop(1)
                _record_storage(pid, storages, refuse)
                stack.append(_OPAQUE)
            elif name == "POP":
                pop(1)
            elif name == "POP_MARK":
                pop_mark()
            elif name == "DUP":
                stack.append(top())
            else:  # PERSID (text ids), EXT*, out-of-band buffers: torch.save writes none of them
                raise refuse(f"its pickle uses opcode {name}, which torch.save does not write")
    except (ValueError, struct.error) as e:
        if isinstance(e, TorchFileError):
            raise
        raise refuse(f"its pickle is malformed ({_first_line(e)})") from None
    return storages


def _record_storage(pid: Any, storages: dict[str, int], refuse) -> None:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
        raise refuse(f"its pickle loads a persistent object {pid!r:.80} that is not a tensor storage")
    _, storage_type, key, location, numel = pid
    itemsize = _storage_itemsize(storage_type)
    if itemsize is None:
        raise refuse(f"its pickle declares a storage of unknown type {storage_type!r:.80}")
    if not isinstance(key, str) or not key.isdigit() or not isinstance(location, str):
        raise refuse(f"its pickle declares a storage with key {key!r:.40} at {location!r:.40}")
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise refuse(f"its pickle declares storage {key} with {numel!r:.40} elements")
    nbytes = numel * itemsize
    if storages.setdefault(key, nbytes) != nbytes:
        raise refuse(f"its pickle declares storage {key} twice, with different sizes")

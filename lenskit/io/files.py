"""A user's files, opened safely: only regular files are read, JSON is read with a size and depth bound, and
every error is one line that names the file.

A FIFO, a socket or a device where a file belongs would make a read wait forever (or read without end), so
every path lenskit reads is checked first: `check_regular_file` for a path that a dependency opens
(safetensors, tokenizers, torch), `read_bytes` and `read_json` for what lenskit reads itself. Those open
with O_NONBLOCK and check the open file again, so a path swapped for a FIFO after the check cannot block
either. Writers call `check_output_file` before any work, and write through `open_output`.

Writing to a pipe is the point in one place only: a CSV table (`--csv`), which a user may stream to another
program (`--csv /dev/stdout | column -t`, `--csv >(sort)`); `pipe_ok=True` allows that, and a FIFO that no
process reads is still refused at once. Figures, model folders, lens folders and checkpoints are files,
never pipes.

>>> folder = Path(lenskit.DEFAULT_MODEL)
>>> config = read_json(folder / "config.json", what="a Hugging Face config.json")
>>> config["model_type"]
'gpt2'
>>> raw = read_bytes(folder / "config.json", max_bytes=1 << 30)
>>> json.loads(raw) == config
True
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path
from typing import IO, Any, Iterator

# config.json files, tokenizer configs, shard indexes and lens configs are kilobytes; the largest real ones
# (a tokenizer_config.json with a long chat template, a shard index of 30,000 tensors) a few megabytes.
JSON_MAX_BYTES = 64 << 20
# Real configs nest 4 or 5 levels (text_config.rope_scaling.*); json itself gives up near 1,000.
JSON_MAX_DEPTH = 64


class NotARegularFileError(OSError):
    """A path that names a FIFO, socket, device or folder where lenskit expects a regular file."""


REGULAR_FILE, FOLDER = "a regular file", "a folder"


def file_kind(mode: int) -> str:
    """What an `st_mode` is, in words: "a regular file", "a FIFO (named pipe)", "a folder", ..."""
    for test, name in ((stat.S_ISREG, REGULAR_FILE), (stat.S_ISDIR, FOLDER), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"


def path_kind(path: str | os.PathLike) -> str | None:
    """What is at `path` (symlinks followed), in `file_kind`'s words; None when nothing is (or a link dangles)."""
    try:
        return file_kind(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _not_regular(path: Path, mode: int, what: str) -> NotARegularFileError:
    return NotARegularFileError(f"{path} is not a regular file but {file_kind(mode)}; expected {what}: "
                                "pass a regular file, or copy the data into one")


def check_regular_file(path: str | os.PathLike, what: str = "a file") -> os.stat_result:
    """The `os.stat` of `path` (symlinks followed), which must be a regular file; a missing path is a
    FileNotFoundError, anything else (FIFO, socket, device, folder) a NotARegularFileError, each one line
    naming the path and `what` was expected. For paths that a dependency opens itself."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist; expected {what}") from None
    except OSError as e:
        raise OSError(f"{path} cannot be read ({e.strerror}); expected {what}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode, what)
    return st


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, what: str = "a file") -> Iterator[tuple[int, os.stat_result]]:
    """A read-only file descriptor of the regular file at `path`, and its `fstat`, closed on exit.

    The path is checked before it is opened (so no device is ever opened), then opened with O_NONBLOCK (so a
    path swapped for a FIFO in between cannot block the open) and checked again through the descriptor."""
    path = Path(path)
    check_regular_file(path, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist; expected {what}") from None
    except OSError as e:
        raise OSError(f"{path} cannot be opened ({e.strerror}); expected {what}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode, what)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # back to plain reads (O_NONBLOCK was only for the open)
        yield fd, st
    finally:
        os.close(fd)


def read_bytes(path: str | os.PathLike, max_bytes: int | None = None, what: str = "a file") -> bytes:
    """The bytes of the regular file at `path`; with `max_bytes`, a larger file is refused before it is read
    (and a file that grows past it while being read, too)."""
    path = Path(path)
    with open_regular(path, what) as (fd, st):
        if max_bytes is not None and st.st_size > max_bytes:
            raise ValueError(f"{path} is {st.st_size:,} bytes, more than the {max_bytes:,} that {what} may hold; "
                             "is it the right file?")
        chunks, total = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            total += len(chunk)
            if max_bytes is not None and total > max_bytes:
                raise ValueError(f"{path} grew past {max_bytes:,} bytes while being read; expected {what}")
        return b"".join(chunks)


def json_depth(value: Any) -> int:
    """How deeply a parsed JSON value nests (a scalar is 0, `[]` and `{}` are 1), without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, dict):
            todo.extend((v, depth + 1) for v in node.values())
            deepest = max(deepest, depth + 1)
        elif isinstance(node, list):
            todo.extend((v, depth + 1) for v in node)
            deepest = max(deepest, depth + 1)
    return deepest


def read_json(path: str | os.PathLike, max_bytes: int = JSON_MAX_BYTES, max_depth: int = JSON_MAX_DEPTH,
              what: str = "a JSON file") -> Any:
    """The JSON value in the regular file at `path`, UTF-8, at most `max_bytes` long and `max_depth` levels
    deep. Every failure (missing, not a regular file, too large, not UTF-8, not JSON, too deep) is one line
    naming the file and `what` it should hold: FileNotFoundError, NotARegularFileError or ValueError.

    >>> read_json(Path(lenskit.DEFAULT_MODEL) / "config.json", what="a Hugging Face config.json")["n_layer"]
    6
    """
    path = Path(path)
    raw = read_bytes(path, max_bytes, what)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); expected {what}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno}); expected {what}") from None
    except RecursionError:
        raise ValueError(f"{path} nests JSON arrays or objects too deeply to read (more than {max_depth} levels); "
                         f"expected {what}") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise ValueError(f"{path} holds a value that cannot be read ({str(e).splitlines()[0]}); expected {what}") from None
    depth = json_depth(value)
    if depth > max_depth:
        raise ValueError(f"{path} nests JSON {depth} levels deep, more than the {max_depth} allowed; expected {what}")
    return value


def read_json_object(path: str | os.PathLike, what: str = "a JSON object", **bounds: int) -> dict[str, Any]:
    """`read_json`, where the value must be a JSON object (ValueError naming the file otherwise)."""
    value = read_json(path, what=what, **bounds)
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, expected {what}")
    return value


# ------------------------------------------------------------------ writing
def check_output_file(path: str | os.PathLike, what: str = "an output file", pipe_ok: bool = False) -> Path:
    """Check, before any work, that `path` can take a new file: it does not exist, or it is a regular file.
    A folder, device or socket is refused; a FIFO too, unless `pipe_ok` (then `open_output` checks it has a
    reader when the output is written). The parent folder is not created here."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return path
    if stat.S_ISREG(st.st_mode):
        return path
    if pipe_ok and (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        return path  # /dev/stdout, a terminal, /dev/null, a named pipe: writing a stream there is the point
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(f"{path} is a folder; expected {what}: pass a file name")
    raise _not_regular(path, st.st_mode, what)


@contextlib.contextmanager
def open_output(path: str | os.PathLike, what: str = "an output file", pipe_ok: bool = False,
                encoding: str = "utf-8", newline: str | None = "") -> Iterator[IO[str]]:
    """A text file open for writing at `path` (see `check_output_file`). With `pipe_ok` (for CSV tables only,
    see the module docstring), a FIFO or character device is written as a stream; a FIFO that no process
    reads is refused at once instead of blocking the open forever.

    >>> frame = pd.DataFrame({"layer": [0, 1], "kl": [0.5, 0.25]})
    >>> with open_output("table.csv", "the --csv table", pipe_ok=True) as f:
    ...     frame.to_csv(f, index=False)
    >>> Path("table.csv").read_text()
    'layer,kl\\n0,0.5\\n1,0.25\\n'
    """
    path = check_output_file(path, what, pipe_ok)
    if path.exists() and stat.S_ISFIFO(os.stat(path).st_mode):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            if e.errno == errno.ENXIO:
                raise OSError(f"{path} is a FIFO (named pipe) that no process is reading, so writing {what} there "
                              "would wait forever; start the reader first, or pass a regular file") from None
            raise OSError(f"{path} cannot be opened for writing ({e.strerror}); expected {what}") from None
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "w", encoding=encoding, newline=newline)
    else:
        f = open(path, "w", encoding=encoding, newline=newline)
    with f:
        yield f

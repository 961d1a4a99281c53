"""Lens folders on disk: the config file's name, reading it, and writing any file atomically."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

from lenskit.io.files import read_json

CONFIG_FILE = "config.json"


def default_file_mode() -> int:
    """The mode `open()` would give a new file here: 0o666 less the process umask."""
    mask = os.umask(0)  # the only portable way to read the umask is to set it and put it back
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Write through `write(tmp_path)` then rename over `path`: a reader sees the old file or the new, never half.

    The temporary file lives in a private folder `.NAME.tmpPID-TID` beside `path` (process and thread, so
    two writers never share one), with any temporary files of
    the writer's own (safetensors makes a `.tmpXXXXXX`), so a run killed mid-write leaves one thing to clear
    (lenses.training.lock does, for the next run). The file gets the permissions an ordinary write would give it
    (0o666 less the umask), whatever mode the writer created it with.
    """
    staging = path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    if staging.is_file():
        staging.unlink()
    staging.mkdir(exist_ok=True)
    tmp = staging / path.name
    try:
        try:
            write(tmp)
        except OSError as e:
            raise _not_written(path, e) from None
        except Exception as e:  # safetensors reports a failed write (a full disk) as its own error type
            if "No space left" not in str(e):
                raise
            raise _not_written(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))) from None
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _not_written(path: Path, e: OSError) -> OSError:
    """One line for a write that failed (a full disk, a quota, an I/O error): what was not written, and that the
    file already there is untouched."""
    kept = f"the previous {path.name} is kept" if path.exists() else f"no {path.name} was written"
    full = " (the disk is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    error = OSError(f"{path} could not be written: {e.strerror or e}{full}; {kept}. Free some space "
                    "(or pass another folder) and run again")
    error.errno = e.errno  # str() stays the one line above
    return error


def read_config(folder: Path) -> dict[str, Any]:
    """The JSON object in a lens folder's config.json; FileNotFoundError says what the folder should hold, and
    ValueError names the file when it is not a JSON object."""
    path = folder / CONFIG_FILE
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no {CONFIG_FILE} in {folder}; expected a tuned-lens folder written by TunedLens.save "
                                "or `lenskit train-lens`")
    # Bounded in size and depth, a FIFO refused: one line naming the file (lenskit.io.files).
    config = read_json(path, what="a lens config; the lens folder is corrupt: save or train the lens again")
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, expected an object of lens settings")
    return config

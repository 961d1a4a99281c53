"""One training run per output folder: an exclusive lock file holding its owner's pid.

Two `train-lens` runs into one `--out` would overwrite each other's checkpoints and one result would be
lost in silence. The first run creates `--out/.lenskit.lock` atomically (O_CREAT | O_EXCL) and removes it
when it ends, also on an exception or Ctrl-C; a second run finds it and refuses. A lock left by a run
that was killed (its pid no longer exists on this host) is stale and is cleared, with any temporary file
that run was writing when it died.

>>> with folder_lock("my_lens"):
...     ...  # train into my_lens
"""

from __future__ import annotations

import functools
import inspect
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

LOCK_FILE = ".lenskit.lock"

F = TypeVar("F", bound=Callable[..., Any])


class FolderLockedError(OSError):
    """Another live process holds the folder's lock (an OSError, so the CLI reports it as one line)."""


def check_writable(folder: str | os.PathLike) -> None:
    """Raise PermissionError (one line, naming the folder) unless `folder`, or the nearest existing folder above
    it where it is yet to be made, can be written; nothing is created."""
    folder = Path(folder)
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise NotADirectoryError(f"{probe} is a file, not a folder; pass a folder as --out")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "" if probe == folder else f" (it would be made inside {probe})"
        raise PermissionError(f"cannot write to {folder}{where}: permission denied; choose a writable --out")


def _owner(path: Path) -> tuple[int | None, str]:
    """(pid, host) written in a lock file; pid None when the file is empty or unreadable."""
    try:
        pid, _, host = path.read_text(encoding="utf-8").strip().partition(" ")
        return int(pid), host
    except (OSError, ValueError):
        return None, ""


def _alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would signal the process there; keep the lock
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def acquire(folder: str | os.PathLike) -> Path:
    """Create the lock file in `folder` (made if missing) or raise FolderLockedError; returns its path."""
    folder = Path(folder)
    check_writable(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pid, host = _owner(path)
            if pid is not None and (host != socket.gethostname() or _alive(pid)):
                raise FolderLockedError(
                    f"{folder} is in use by another training run (pid {pid} on {host or 'this host'}); wait for it to "
                    f"finish or pass another --out. If no run is using it, delete {path}") from None
            if pid is None and _young(path):
                raise FolderLockedError(f"{folder} is being locked by another run just now; pass another --out, "
                                        f"or delete {path} if no run is using it") from None
            path.unlink(missing_ok=True)  # stale: its owner was killed
            if pid is not None:
                for partial in folder.glob(f".*.tmp{pid}"):  # what it was writing when killed (see write_atomic)
                    if partial.is_dir():
                        shutil.rmtree(partial, ignore_errors=True)
                    else:
                        partial.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {socket.gethostname()}\n")
        return path
    raise FolderLockedError(f"could not lock {folder}: another run keeps taking {path}; pass another --out")


def _young(path: Path, seconds: float = 5.0) -> bool:
    """An empty lock file younger than this may be a run writing its pid right now."""
    try:
        return time.time() - path.stat().st_mtime < seconds
    except OSError:
        return False


def release(path: Path) -> None:
    """Remove the lock file if it is still ours."""
    pid, _ = _owner(path)
    if pid == os.getpid():
        path.unlink(missing_ok=True)


@contextmanager
def folder_lock(folder: str | os.PathLike) -> Iterator[Path]:
    """Hold `folder`'s lock for the body of a `with` block; released however the block ends.

    Folders the lock had to make are removed again if the body left them empty (a refused run leaves no trace)."""
    folder = Path(folder).absolute()
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    path = acquire(folder)
    try:
        yield path
    finally:
        release(path)
        for p in made:  # deepest first
            try:
                p.rmdir()
            except OSError:
                break  # not empty (or gone): it holds the run's files


def locks_out_folder(fn: F) -> F:
    """Decorate a training function that takes `out`: the call holds `out`'s lock (on rank 0 only; the other
    ranks of a distributed run write nothing). `out=None` takes no lock."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = signature.bind(*args, **kwargs).arguments.get("out")
        if out is None or not _is_rank_zero():
            return fn(*args, **kwargs)
        with folder_lock(out):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _is_rank_zero() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

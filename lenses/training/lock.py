"""One writer per lens folder: a kernel lock (`flock`) on `FOLDER/.lenskit.lock`, taken by `train-lens`, the
Jacobian-lens fit, `TunedLens.save` / `JacobianLens.save` and `eval-lens --card`.

Two `train-lens` runs into one `--out` would overwrite each other's checkpoints and one result would be
lost in silence. A run holds the lock while it trains, and a second run is refused at once. The kernel
drops the lock when its holder exits, however it exits (SIGKILL included), so a lock is never stale: a
killed run's lock file is one the next run simply locks. The file names its holder (pid and host) for the
refusal message only. Without fcntl (Windows) the `filelock` package takes the lock, and names no pid.

Within one process a second holder is refused too, except a writer that joins (`folder_lock(f, join=True)`,
as `save` does): inside the thread's own hold it goes ahead (a training run saves its lens into the folder
it holds), and it waits for another thread of this process, so threads saving one folder take turns.

>>> with folder_lock("my_lens"):
...     pass  # train into my_lens
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lenskit.lock"

F = TypeVar("F", bound=Callable[..., Any])


class FolderLockedError(OSError):
    """Another live process holds the folder's lock (an OSError, so the CLI reports it as one line)."""


# Folders this process holds: absolute path -> [its thread lock, the holding thread's id or None].
_held: dict[Path, list] = {}
_held_guard = threading.Lock()


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


def _lock(path: Path) -> Callable[[], None] | None:
    """Lock `path` without waiting and return the function that unlocks it, or None if another process holds it."""
    if fcntl is None:  # Windows: msvcrt's lock, which the OS also drops when its holder dies
        import filelock

        lock = filelock.FileLock(path, timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            return None
        return lock.release
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # we locked a file its last holder had just unlinked: lock the one now at `path`
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())

    def unlock() -> None:
        path.unlink(missing_ok=True)  # before unlocking, so a run that opened it meanwhile sees it gone (above)
        os.close(fd)

    return unlock


def _holder(path: Path) -> str:
    with contextlib.suppress(OSError, ValueError):  # unreadable on Windows; empty while its holder writes it
        pid, host = path.read_text(encoding="utf-8").split()
        return f" (pid {pid} on {host})"
    return ""


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, join: bool = False) -> Iterator[Path]:
    """Hold `folder`'s lock (the folder is made if missing) for the body of a `with` block, or raise
    FolderLockedError at once if another process holds it, or another holder in this process.

    `join=True` is for a writer that may run inside a holder (`save`, called by a training run on its own
    folder): in the thread that holds the lock it goes ahead, and it waits for another thread of this process
    to finish, where a second process is still refused at once. Folders the lock had to make are removed again
    if the body left them empty (a refused run leaves no trace)."""
    folder = Path(folder).absolute()
    with _held_guard:
        entry = _held.setdefault(folder, [threading.Lock(), None])  # [lock, holding thread]
    me = threading.get_ident()
    if join and entry[1] == me:  # inside this thread's own hold
        yield folder / LOCK_FILE
        return
    if not entry[0].acquire(blocking=join and entry[1] != me):
        raise FolderLockedError(f"{folder} is in use by another lenskit run{_holder(folder / LOCK_FILE)} (in this "
                                f"process, pid {os.getpid()}); wait for it to finish or pass another --out")
    entry[1] = me
    try:
        with _process_lock(folder) as path:
            yield path
    finally:
        entry[1] = None
        entry[0].release()


@contextlib.contextmanager
def _process_lock(folder: Path) -> Iterator[Path]:
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    check_writable(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    unlock = _lock(path)
    if unlock is None:
        raise FolderLockedError(f"{folder} is in use by another lenskit run{_holder(path)} (train-lens, a save, "
                                "eval-lens --card, a Jacobian-lens fit or an activation export into the same folder); "
                                "wait for it to finish or pass another --out")
    try:
        for partial in folder.glob(".*.tmp[0-9]*"):  # write_atomic's staging folders, left by a run killed mid-write
            shutil.rmtree(partial, ignore_errors=True)
        yield path
    finally:
        unlock()
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

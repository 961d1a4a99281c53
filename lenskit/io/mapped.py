"""The files a loaded model's weights are memory-mapped from, and a cheap check that they did not change.

`from_pretrained` leaves a checkpoint that is already in the asked dtype memory-mapped: the weights are the
file's pages. A file edited in place under the model then changes its next forward silently, and a file
truncated under it kills the process with SIGBUS when a forward touches a page past the new end. So each
mapped file is held open from load on, its identity (st_dev, st_ino, st_size, st_mtime_ns) recorded, and
`WeightFiles.check()`, run before every forward, compares it with an `os.fstat` of the open file: about a
microsecond per file. The open descriptor follows the inode that is mapped, so a file *replaced* by rename
(what `save_pretrained`, safetensors' `save_file` and the hub download all do) leaves the mapping and the
model intact and is not refused; an in-place write or truncation is.

What avoids the hazard: `from_pretrained(..., mmap=False)` reads the weights into memory (no file is
touched after load), and a tool that writes checkpoints should write a new file and rename it over the old.
A truncation *during* a forward cannot be caught by any check before it; only `mmap=False` avoids that.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Iterable


class WeightsChangedError(OSError):
    """A memory-mapped weights file was written to after the model was loaded from it."""


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """(st_dev, st_ino, st_size, st_mtime_ns): what a file is, and whether it was written since."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class WeightFiles:
    """Open descriptors of the weight files a model maps, with each one's identity at load.

    >>> folder = Path(lenskit.DEFAULT_MODEL)
    >>> files = WeightFiles([folder / "model.safetensors"])   # before the files are read
    >>> files.confirm()                                        # after: nothing changed while reading
    >>> files.check()                                          # before each forward
    """

    def __init__(self, paths: Iterable[str | os.PathLike] = ()) -> None:
        self.paths: list[Path] = []
        self._fds: list[int] = []
        self._identities: list[tuple[int, int, int, int]] = []
        try:
            for path in paths:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
                self._fds.append(fd)
                self.paths.append(Path(path))
                self._identities.append(identity(os.fstat(fd)))
        except BaseException:
            self.close()
            raise
        # The descriptors close with this object (the model dropped), or at exit.
        self._finalizer = weakref.finalize(self, _close_all, self._fds)

    def __bool__(self) -> bool:
        return bool(self._fds)

    def confirm(self) -> None:
        """After the files were read: each path still names the file that was opened, unchanged."""
        for path, fd, then in zip(self.paths, self._fds, self._identities):
            if identity(os.stat(path)) != then or identity(os.fstat(fd)) != then:
                raise WeightsChangedError(f"{path} changed while it was being read; load the model again once "
                                          "nothing is writing to it")

    def check(self) -> None:
        """Refuse (WeightsChangedError) if any mapped file was written or truncated since load."""
        for path, fd, then in zip(self.paths, self._fds, self._identities):
            if identity(os.fstat(fd)) != then:
                raise WeightsChangedError(
                    f"weights file changed since load; reload the model ({path} was written to in place while this "
                    "model's weights were memory-mapped from it; to edit weight files under a loaded model, load "
                    "it with from_pretrained(..., mmap=False))")

    def close(self) -> None:
        """Stop checking: close the descriptors (the mapping itself lives as long as the weights do)."""
        _close_all(self._fds)
        self.paths, self._identities = [], []

    # A copy of a model holds copies of its weights, in memory: it maps nothing.
    def __deepcopy__(self, memo: dict) -> "WeightFiles":
        return WeightFiles()

    def __reduce__(self):
        return (WeightFiles, ())

    def __repr__(self) -> str:
        return f"WeightFiles({[p.as_posix() for p in self.paths]})"


def _close_all(fds: list[int]) -> None:
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass

"""Run a call in a forked child with a deadline, for inputs that could hang or kill the process (a FIFO where
a file belongs, a weights file truncated under a memory map). A hang inside Rust or C code (safetensors,
tokenizers) never returns to Python, so an alarm in the test process could not stop it; a child can be killed.

>>> outcome = run_forked(lambda: HookedTransformer.from_pretrained(folder), timeout=20)
>>> outcome.raised("NotARegularFileError", "is not a regular file")
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Outcome:
    kind: str  # "returned", "raised", "hung" or "died"
    type_name: str = ""
    message: str = ""
    value: Any = None
    seconds: float = 0.0
    mro: tuple[str, ...] = ()

    def raised(self, type_name: str, *words: str) -> "Outcome":
        """Assert the call raised `type_name` (or a subclass), one line holding every word."""
        assert self.kind == "raised", f"expected {type_name}, but the call {self.kind} {self.message or self.value!r:.300}"
        assert type_name in self.mro, f"expected {type_name}, got {self.type_name}: {self.message}"
        assert "\n" not in self.message.strip(), f"not one line: {self.message}"
        for word in words:
            assert word in self.message, f"{word!r} is not in the message: {self.message}"
        return self


def run_forked(fn: Callable[[], Any], timeout: float = 20.0) -> Outcome:
    """fn() in a forked child: what it returned (if picklable), raised (type, MRO names, message), or whether it
    hung past `timeout` seconds (then it is killed) or died of a signal."""
    read_end, write_end = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's exit handlers
        os.close(read_end)
        try:
            try:
                value = fn()
                try:
                    payload = ("returned", "", "", pickle.loads(pickle.dumps(value)), ())
                except Exception:  # noqa: BLE001 - the value does not travel; its repr does
                    payload = ("returned", "", "", repr(value)[:2000], ())
            except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
                payload = ("raised", type(e).__name__, str(e), None, tuple(c.__name__ for c in type(e).__mro__))
            with os.fdopen(write_end, "wb") as f:
                f.write(pickle.dumps(payload))
        finally:
            os._exit(0)
    os.close(write_end)
    chunks = []
    deadline = start + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return Outcome("hung", seconds=time.monotonic() - start)
            ready, _, _ = select.select([read_end], [], [], left)
            if ready:
                chunk = os.read(read_end, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    seconds = time.monotonic() - start
    if not chunks:
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        return Outcome("died", message=f"signal {signal.Signals(sig).name}" if sig else f"status {status}", seconds=seconds)
    kind, type_name, message, value, mro = pickle.loads(b"".join(chunks))
    return Outcome(kind, type_name, message, value, seconds, mro)

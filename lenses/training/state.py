"""Training state read back from disk, checked field by field before it is used: a checkpoint's metadata and a
finished lens's training record. Each refusal is one line naming the file and the field; the file is kept."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _history(v: object) -> bool:
    """A loss history: one list of finite numbers per step done."""
    return isinstance(v, list) and all(
        isinstance(row, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                      for x in row) for row in v)


Check = tuple[Callable[[object], bool], str]
CHECKPOINT_FIELDS: dict[str, Check] = {
    "step": (_count, "the number of steps done, an integer >= 0"),
    "history": (_history, "the loss history, a list of lists of finite numbers (one per step)"),
    "identity": (lambda v: isinstance(v, dict), "the run identity, an object (recipe, data, model, ...)"),
    "scalars": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of tensor names"),
}
FINISHED_FIELDS: dict[str, Check] = {
    "steps_done": (_count, "the number of steps done, an integer >= 0"),
    "loss_history": (_history, "the loss history, a list of lists of finite numbers (one per step)"),
    "run_identity": (lambda v: isinstance(v, dict), "the run identity, an object (recipe, data, model, ...)"),
}


def _check(record: Any, fields: dict[str, Check], where: Path, what: str, remedy: str) -> dict:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: {what} must be a JSON object, got {json.dumps(record)[:60]}; {remedy}")
    for key, (ok, want) in fields.items():
        if key not in record:
            raise ValueError(f"{where}: {what} has no {key!r} ({want}); {remedy}")
        if not ok(record[key]):
            raise ValueError(f"{where}: {what} field {key!r} must be {want}, got {json.dumps(record[key])[:60]}; {remedy}")
    return record


def check_checkpoint_meta(meta: Any, path: Path) -> dict:
    """A checkpoint's metadata, every field checked (ValueError naming `path` and the field)."""
    return _check(meta, CHECKPOINT_FIELDS, path, "the checkpoint metadata",
                  "the checkpoint was kept; to start over, delete it (or pass another --out)")


def check_finished_state(config: Any, path: Path) -> dict:
    """A finished lens's training record (config.json), checked before a run extends it."""
    return _check(config, FINISHED_FIELDS, path, "the lens config",
                  "it cannot be extended; train into another --out, or save or train the lens again")

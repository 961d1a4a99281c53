"""Lens folders on disk: the config file's name, reading it, and writing any file atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

CONFIG_FILE = "config.json"


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """Write through `write(tmp_path)` then rename over `path`: a reader sees the old file or the new, never half."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_config(folder: Path) -> dict[str, Any]:
    """The JSON config of a lens folder, or FileNotFoundError that says what the folder should hold."""
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {folder}; expected a tuned-lens folder written by TunedLens.save "
                                "or `lenskit train-lens`")
    return json.loads((folder / CONFIG_FILE).read_text())

"""The local Hugging Face hub cache, trusted only as far as its layout: a hub name must resolve to a snapshot
inside the cache, whose links point into the repo's own `blobs/`.

The cache is `<cache>/models--<org>--<name>/` with `refs/<branch>` (a file holding a commit hash),
`snapshots/<commit>/` (one folder per commit, of symlinks) and `blobs/` (the files). huggingface_hub
joins a ref's text into a path as it is, so a `refs/main` holding `../../../../x` would load a folder from
anywhere on disk; these checks run before and after it resolves a name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .files import read_bytes

# What a ref may hold: a commit hash, or at most a plain folder name (no separator, no leading dot).
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


class HubCacheError(ValueError):
    """A hub cache entry that would resolve outside the cache, or that is not laid out as huggingface_hub lays it."""


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """The hub cache folder: `cache_dir`, else huggingface_hub's (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub)."""
    if cache_dir is None:
        from huggingface_hub import constants

        cache_dir = constants.HF_HUB_CACHE
    return Path(cache_dir).expanduser()


def repo_folder(cache_dir: str | os.PathLike | None, repo_id: str, repo_type: str = "model") -> Path:
    """`<cache>/models--org--name`, as huggingface_hub names a repo's folder."""
    return cache_root(cache_dir) / f"{repo_type}s--{repo_id.replace('/', '--')}"


def _refuse(repo: Path, why: str) -> HubCacheError:
    return HubCacheError(f"the Hugging Face cache entry {repo} is unsafe: {why}; the cache is corrupt or was tampered "
                         f"with: delete {repo} and download the repo again")


def check_ref(cache_dir: str | os.PathLike | None, repo_id: str, revision: str = "main") -> None:
    """Before huggingface_hub reads `refs/<revision>`: the ref, where there is one, is a regular file holding
    a commit hash or a plain name (so it cannot hang the read, or name a folder outside the cache)."""
    repo = repo_folder(cache_dir, repo_id)
    ref = repo / "refs" / revision
    if not os.path.lexists(ref):
        return
    try:
        raw = read_bytes(ref, max_bytes=256, what="a hub ref (a file holding a commit hash)")
    except (OSError, ValueError) as e:
        raise _refuse(repo, str(e)) from None
    text = raw.decode("utf-8", errors="replace")
    if not (COMMIT_HASH.fullmatch(text) or PLAIN_NAME.fullmatch(text)):
        raise _refuse(repo, f"refs/{revision} holds {text!r:.80}, expected a commit hash (40 hex digits) or a plain name")


def check_snapshot(cache_dir: str | os.PathLike | None, repo_id: str, snapshot: str | os.PathLike) -> Path:
    """The real path of a snapshot folder that huggingface_hub resolved, once it is known to be
    `<repo>/snapshots/<plain name>` inside the cache and every symlink in it (files and folders, at any
    depth) points into `<repo>/blobs/`. HubCacheError otherwise, before anything in it is read."""
    root = cache_root(cache_dir).resolve()
    repo = repo_folder(root, repo_id)
    real = Path(snapshot).resolve()
    if real.parent != (repo / "snapshots").resolve() or not PLAIN_NAME.fullmatch(real.name) or not real.is_relative_to(root):
        raise _refuse(repo, f"the snapshot resolves to {real}, outside {repo / 'snapshots'}")
    blobs = (repo / "blobs").resolve()
    for dirpath, dirnames, filenames in os.walk(real):  # links to folders are listed, never followed
        for name in (*dirnames, *filenames):
            entry = Path(dirpath) / name
            if entry.is_symlink():
                target = entry.resolve()
                if not target.is_relative_to(blobs):
                    raise _refuse(repo, f"{entry.relative_to(real)} in snapshot {real.name} links to {target}, "
                                        f"outside {blobs}")
    return real


def check_cached_file(cache_dir: str | os.PathLike | None, repo_id: str, path: str | os.PathLike) -> Path:
    """A file that huggingface_hub resolved inside a snapshot: the snapshot is checked (`check_snapshot`), and
    the file must lie inside it. Returns the path of the file in the checked snapshot."""
    repo = repo_folder(cache_dir, repo_id)
    snapshots = os.path.normpath(os.path.abspath(repo / "snapshots"))
    here = os.path.normpath(os.path.abspath(path))
    rel = os.path.relpath(here, snapshots)
    if rel.startswith(os.pardir) or os.sep not in rel:
        raise _refuse(repo, f"{path} is not a file inside {repo / 'snapshots'}")
    name, _, inside = rel.partition(os.sep)
    return check_snapshot(cache_dir, repo_id, Path(snapshots) / name) / inside

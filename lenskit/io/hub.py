"""Where a model's folder is: an embedded model by its short name, a local folder, or a hub repository through
the local Hugging Face cache (downloaded only when the network allows). Every path out of the cache is checked to
stay inside it (lenskit.io.hubcache)."""

from __future__ import annotations

import os
import re
import stat
import warnings
from pathlib import Path

from ..families import PRESETS
from ..suggest import did_you_mean
from .files import file_kind
from .hubcache import HubCacheError, check_cached_file, check_ref, check_snapshot

HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json", "vocab.json",
             "merges.txt", "tokenizer_config.json", "special_tokens_map.json"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# The models that ship inside the package, by short name -> folder beside this package's parent.
EMBEDDED_MODELS = {"stdlib-gpt2": "default_model", "stdlib-llama": "stdlib_llama"}
# TransformerLens's own names that are no hub repository, -> the repository they name there.
TRANSFORMER_LENS_NAMES = {"gpt2-small": "openai-community/gpt2"}


def embedded_model_folder(name: str) -> Path:
    """The folder of an embedded model by its short name (`stdlib-gpt2`, `stdlib-llama`)."""
    if name not in EMBEDDED_MODELS:
        raise KeyError(f"no embedded model named {name!r}; lenskit ships {sorted(EMBEDDED_MODELS)}")
    return Path(__file__).resolve().parents[1] / EMBEDDED_MODELS[name]


def model_label(name_or_path: str | os.PathLike, folder: Path) -> str:
    """The name lenskit writes for a model (cfg.name: cards, provenance, figures, errors), the same on every machine:
    an embedded model's short name, a hub name as given, a relative folder as given, and an absolute folder by its
    own name, since the machine's path means nothing elsewhere (the fingerprint identifies the weights)."""
    resolved = folder.resolve()
    short = next((name for name in EMBEDDED_MODELS if embedded_model_folder(name) == resolved), None)
    if short is not None:
        return short
    text = str(name_or_path)
    path = Path(text).expanduser()
    if not path.exists():
        return text  # a hub name, resolved through the cache
    return folder.name if path.is_absolute() else path.as_posix()


def resolve_model_folder(name_or_path: str | os.PathLike) -> Path:
    """An embedded model's short name first (`stdlib-gpt2`, `stdlib-llama`), then a local folder as is, then
    a hub name (`gpt2`, `openai-community/gpt2`) through the local HF cache, downloading only when the
    network allows.

    A short name always means the embedded model, even where a folder of that name exists in the working
    directory (that is said, as a warning): spell the folder as a path, `./stdlib-llama`, to load it."""
    text = str(name_or_path)
    if text in EMBEDDED_MODELS:
        folder = embedded_model_folder(text)
        if Path(text).is_dir():
            warnings.warn(f"{text!r} names lenskit's embedded model; the folder ./{text} here is not loaded "
                          f"(pass ./{text} to load it)", UserWarning, stacklevel=3)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"the embedded model {text} is missing at {folder}; reinstall lenskit")
        return folder
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    text = str(name_or_path)
    if path.exists():
        mode = os.stat(path).st_mode
        kind = "a file" if stat.S_ISREG(mode) else f"{file_kind(mode)}, not a folder"
        raise NotADirectoryError(f"{text} is {kind}; pass the folder that holds config.json and the weights")
    if not _HUB_ID.match(text) or text.startswith((".", "~")):
        raise FileNotFoundError(f"no folder at {text}; pass a Hugging Face model folder or a hub name")
    near = did_you_mean(text, EMBEDDED_MODELS, cutoff=0.8) if "/" not in text else ""
    if near:  # a misspelt embedded model: say so before any hub lookup
        raise FileNotFoundError(f"no model named {text!r}{near} lenskit ships {', '.join(EMBEDDED_MODELS)}; "
                                "a hub name carries its organisation (openai-community/gpt2)")
    return _from_hub(text)


def _hub_cache_dir() -> str | None:
    """The hub cache folder, read from the environment now: huggingface_hub reads it once, at import."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return os.path.expanduser(env[var])
    if env.get("HF_HOME"):
        return os.path.join(os.path.expanduser(env["HF_HOME"]), "hub")
    return None  # huggingface_hub's default (~/.cache/huggingface/hub)


def _hub_offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return constants.HF_HUB_OFFLINE or any(f.strip().lower() in ("1", "true", "yes", "on") for f in flags)


def _from_hub(name: str) -> Path:
    from huggingface_hub import snapshot_download

    cache_dir = _hub_cache_dir()
    short = name in PRESETS and PRESETS[name].family == "gpt2"  # gpt2, gpt2-xl... now live under openai-community/
    candidates = [name] + ([f"openai-community/{name}"] if short else [])
    for repo_id in candidates:
        check_ref(cache_dir, repo_id)  # a ref that would hang the read or name a folder outside the cache
        try:
            snapshot = snapshot_download(repo_id, allow_patterns=HUB_FILES, cache_dir=cache_dir, local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached under this id; try the next one
            continue
        return check_snapshot(cache_dir, repo_id, snapshot)
    reason = "HF_HUB_OFFLINE is set"
    if not _hub_offline():
        try:
            snapshot = snapshot_download(candidates[-1], allow_patterns=HUB_FILES, cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001 - any network or hub failure gets the same advice
            reason = f"download failed: {type(e).__name__}: {e}"
        else:
            return check_snapshot(cache_dir, candidates[-1], snapshot)
    repo_id = TRANSFORMER_LENS_NAMES.get(name, candidates[-1])
    where = f"{name!r} is not a local folder, and not in the local Hugging Face cache ({cache_dir or 'default location'})"
    if name in TRANSFORMER_LENS_NAMES:
        where += f"; it is TransformerLens's name for the hub's {repo_id}"
    elif "/" not in repo_id:  # a bare name that is no hub repository lenskit knows: no download to advise
        known = [*EMBEDDED_MODELS, *TRANSFORMER_LENS_NAMES, *(p for p in PRESETS if PRESETS[p].family == "gpt2")]
        raise OSError(f"{where}, and it could not be fetched ({reason}){did_you_mean(name, known)}; pass a local "
                      "folder, or a hub name with its organisation (openai-community/gpt2, EleutherAI/pythia-70m)")
    raise OSError(
        f"{where}; it could not be fetched ({reason}). Pass a local folder instead: on a machine with network, run "
        f"`hf download {repo_id}` (or save_pretrained a model), copy the folder here, then "
        "HookedTransformer.from_pretrained('/path/to/folder')"
    )


def resolve_hub_file(repo_id: str, filename: str) -> Path:
    """One file of a hub repo (`filename` may be a path inside it), resolved as hub models are: the local
    Hugging Face cache first, downloaded only when the network allows; otherwise an OSError saying what to do."""
    from huggingface_hub import hf_hub_download

    cache_dir = _hub_cache_dir()
    check_ref(cache_dir, repo_id)
    try:
        return check_cached_file(cache_dir, repo_id, hf_hub_download(repo_id, filename, cache_dir=cache_dir, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - not cached; try the network below when allowed
        if isinstance(e, HubCacheError):
            raise
    reason = "HF_HUB_OFFLINE is set"
    if not _hub_offline():
        try:
            path = hf_hub_download(repo_id, filename, cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001 - any network or hub failure gets the same advice
            reason = f"download failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        else:
            return check_cached_file(cache_dir, repo_id, path)
    raise OSError(f"{filename!r} of hub repo {repo_id!r} is not in the local Hugging Face cache ({cache_dir or 'default location'}) "
                  f"and could not be fetched ({reason}); on a machine with network run `hf download {repo_id} {filename}`, "
                  "or pass the local file")

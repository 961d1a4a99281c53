"""Weights in and out of each family's Hugging Face layout.

Converting a checkpoint is a pure function from a flat name -> tensor mapping (and our parameter
shapes, read from a model built on the meta device) to our state dict: the family's declarative name
map and reshape list (layouts.py, found through the registry in families.py), and a check of every key, shape, dtype and value. Nothing is guessed and nothing is silently initialised. Files are read with safetensors
(memory-mapped); pickle checkpoints are refused, never opened.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import ModelConfig
from ..families import PRESETS, family_of
from .tokenizer import load_tokenizer, save_tokenizer

if TYPE_CHECKING:
    from ..model import HookedTransformer

HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json", "vocab.json",
             "merges.txt", "tokenizer_config.json", "special_tokens_map.json"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class CheckpointError(ValueError):
    """A checkpoint that does not match what its config promises, or that cannot be read safely."""


def hf_name_map(cfg: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """Every checkpoint name (without the base-model prefix) -> our name, for the parameters in `shapes`.
    A tied unembedding is not expected in the file (it may be there; then it must equal the embedding)."""
    keys = [k for k in shapes if not (cfg.tie_word_embeddings and k == "unembed.weight")]
    return family_of(cfg.family).layout.name_map(keys, cfg.n_layers)


def model_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a model, typically built on the meta device (no memory, no init)."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def expected_shapes(cls: type["HookedTransformer"], cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter shape of `cls(cfg)`, from a one-block model on the meta device: blocks have equal
    shapes, so a config claiming thousands of layers is checked against the files before anything large is built."""
    with torch.device("meta"):
        one = model_shapes(cls(cfg.replace(n_layers=1)))
    shapes = {k: v for k, v in one.items() if not k.startswith("blocks.")}
    block = {k.removeprefix("blocks.0."): v for k, v in one.items() if k.startswith("blocks.0.")}
    shapes.update({f"blocks.{i}.{k}": v for i in range(cfg.n_layers) for k, v in block.items()})
    return shapes


def convert_hf_state_dict(raw: Mapping[str, torch.Tensor], cfg: ModelConfig,
                          shapes: Mapping[str, tuple[int, ...]], check_finite: bool = True) -> dict[str, torch.Tensor]:
    """A checkpoint of `cfg.family` -> our state dict, checked against our `shapes`. Keys may carry the
    base-model prefix (`transformer.`, `gpt_neox.`, `model.`) or not; stored buffers without learned
    state are skipped; a tied `lm_head` may be present or absent. Any unknown, missing or misshapen key,
    and any non-float or (unless `check_finite=False`) non-finite tensor, raises naming the tensor."""
    layout = family_of(cfg.family).layout
    stripped: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        name = key.removeprefix(layout.prefix)
        name = layout.aliases.get(name, name)
        if name in stripped:
            raise CheckpointError(f"checkpoint holds {name!r} twice, under {key!r} and another spelling (prefix or alias)")
        if layout.is_buffer(name):
            continue
        stripped[name] = tensor
    tied_head = layout.top["unembed.weight"]
    lm_head = stripped.pop(tied_head, None) if cfg.tie_word_embeddings else None

    name_map = hf_name_map(cfg, shapes)
    unexpected = sorted(set(stripped) - set(name_map))
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} tensor(s) that a {cfg.family} model with n_layers={cfg.n_layers} does not: "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    missing = [n for n in name_map if n not in stripped]  # in the model's own order
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    state: dict[str, torch.Tensor] = {}
    for theirs, ours in name_map.items():
        stored = stripped[theirs]
        check_values(theirs, stored, check_finite)
        want = layout.stored_shape(ours, shapes[ours])
        if tuple(stored.shape) != want:
            raise CheckpointError(f"tensor {theirs!r} has shape {tuple(stored.shape)}, but config.json implies {want}")
        state[ours] = layout.to_ours(ours, stored, cfg)
    if cfg.tie_word_embeddings:
        embed = state["embed.weight"]
        if lm_head is not None and (lm_head.shape != embed.shape or not torch.equal(lm_head, embed)):
            raise CheckpointError(f"config says tie_word_embeddings=true, but {tied_head} differs from the embedding")
        state["unembed.weight"] = embed
    return state


def check_values(name: str, tensor: torch.Tensor, check_finite: bool = True) -> None:
    """A weight must be floating point and finite; a NaN or inf would poison every forward silently."""
    if not tensor.dtype.is_floating_point:
        raise CheckpointError(f"tensor {name!r} has dtype {tensor.dtype}; weights must be floating point "
                              "(quantised checkpoints are not supported: dequantise first)")
    if not check_finite:
        return
    # One reduction instead of an elementwise mask: a NaN or inf anywhere makes the sum non-finite. It allocates
    # nothing the size of the tensor, and reads a memory-mapped file's pages as file pages (not anonymous memory).
    # A sum can also overflow on finite values (fp16 above 65504), so only then is every element looked at.
    if not bool(torch.isfinite(tensor.sum())) and not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"tensor {name!r} holds NaN or inf values; the checkpoint is corrupt or was saved after training diverged")


def to_hf_state_dict(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `convert_hf_state_dict`: our state dict under the family's checkpoint names (with the
    base-model prefix, as transformers' causal-LM class saves them) and in its stored shapes. A tied
    unembedding is left out, as transformers leaves it out."""
    layout = family_of(cfg.family).layout
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    out = {}
    for theirs, ours in hf_name_map(cfg, shapes).items():
        tensor = layout.to_stored(ours, state[ours].detach(), cfg)
        key = theirs if theirs == layout.top["unembed.weight"] else f"{layout.prefix}{theirs}"
        out[key] = tensor.contiguous().cpu()
    return out


# ------------------------------------------------------------------ files
def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint, memory-mapped."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map' object): {e}") from e
        for shard in shards:
            if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
                raise CheckpointError(f"{index} names shard {shard!r}; shards must be .safetensors files in the same folder")
        files = [folder / s for s in shards]
    elif single.exists():
        files, weight_map = [single], None
    else:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")] + [p.name for p in folder.glob("*.ckpt")]
        found = f"; found {sorted(pickles)}, which lenskit refuses to unpickle" if pickles else ""
        raise CheckpointError(
            f"{folder} has no model.safetensors or model.safetensors.index.json{found}. Convert the checkpoint "
            "to safetensors with a tool you trust, e.g. transformers' save_pretrained(..., safe_serialization=True)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.exists():
            raise CheckpointError(f"shard {file.name} listed in {index.name} does not exist in {folder}")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key in tensors:
                        raise CheckpointError(f"tensor {key!r} appears in more than one shard")
                    tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from e
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise CheckpointError(f"{index.name} lists tensor(s) that no shard holds: {absent[:5]}")
    return tensors


# The models that ship inside the package, by short name -> folder beside this package's parent.
EMBEDDED_MODELS = {"stdlib-gpt2": "default_model", "stdlib-llama": "stdlib_llama"}


def embedded_model_folder(name: str) -> Path:
    """The folder of an embedded model by its short name (`stdlib-gpt2`, `stdlib-llama`)."""
    if name not in EMBEDDED_MODELS:
        raise KeyError(f"no embedded model named {name!r}; lenskit ships {sorted(EMBEDDED_MODELS)}")
    return Path(__file__).resolve().parents[1] / EMBEDDED_MODELS[name]


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
        raise NotADirectoryError(f"{text} is a file; pass the folder that holds config.json and the weights")
    if not _HUB_ID.match(text) or text.startswith((".", "~")):
        raise FileNotFoundError(f"no folder at {text}; pass a Hugging Face model folder or a hub name")
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
        try:
            return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, cache_dir=cache_dir, local_files_only=True))
        except Exception:  # noqa: BLE001 - not cached under this id; try the next one
            continue
    reason = "HF_HUB_OFFLINE is set"
    if not _hub_offline():
        try:
            return Path(snapshot_download(candidates[-1], allow_patterns=HUB_FILES, cache_dir=cache_dir))
        except Exception as e:  # noqa: BLE001 - any network or hub failure gets the same advice
            reason = f"download failed: {type(e).__name__}: {e}"
    raise OSError(
        f"{name!r} is not a local folder, and not in the local Hugging Face cache ({cache_dir or 'default location'}); it could not be "
        f"fetched ({reason}). Pass a local folder instead: on a machine with network, run "
        f"`hf download {candidates[-1]}` (or save_pretrained a model), copy the folder here, then "
        "HookedTransformer.from_pretrained('/path/to/folder')"
    )


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """A floating torch dtype from a dtype, its name ("bfloat16", "torch.float16"), or None (float32)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ValueError(f"dtype={dtype!r} is not supported; pass one of {sorted(DTYPES)} or the matching torch dtype")


def load_pretrained(cls: type["HookedTransformer"], name_or_path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: str | torch.device | None = None, check_finite: bool = True) -> "HookedTransformer":
    dtype = parse_dtype(dtype)
    folder = resolve_model_folder(name_or_path)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{folder} has no config.json; expected a Hugging Face model folder")
    cfg = ModelConfig.from_json(config_file, name=str(name_or_path))
    return _assemble(cls, cfg, read_safetensors(folder), load_tokenizer(folder), dtype, device or "cpu", check_finite)


def from_hf(cls: type["HookedTransformer"], hf_model: torch.nn.Module, tokenizer=None) -> "HookedTransformer":
    cfg = ModelConfig.from_hf_config(hf_model.config, name=getattr(hf_model.config, "name_or_path", "") or "custom")
    param = next(hf_model.parameters())
    raw = {k: v.detach() for k, v in hf_model.state_dict().items()}
    return _assemble(cls, cfg, raw, tokenizer, param.dtype, param.device)


def _assemble(cls, cfg, raw, tokenizer, dtype, device, check_finite: bool = True) -> "HookedTransformer":
    """Build on the meta device, convert the checkpoint against its shapes, then assign the tensors:
    a checkpoint already in `dtype` on the CPU is used in place (memory-mapped), not copied."""
    state = convert_hf_state_dict(raw, cfg, expected_shapes(cls, cfg), check_finite)
    with torch.device("meta"):
        model = cls(cfg, tokenizer=tokenizer)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.eval()


def save_pretrained(model: "HookedTransformer", folder: str | os.PathLike) -> None:
    """The family's Hugging Face folder: config.json, model.safetensors and the tokenizer files. Both are
    built before anything is written, so a family or config that cannot be saved leaves the folder as it was."""
    config = model.cfg.to_hf_dict()
    tensors = to_hf_state_dict(model.state_dict(), model.cfg)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # A stale shard index would take precedence over the file just written.
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    if model.tokenizer is not None:
        save_tokenizer(model.tokenizer, folder)

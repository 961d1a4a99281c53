"""Weights in and out of the Hugging Face GPT-2 layout.

Converting a checkpoint is a pure function from a flat name -> tensor mapping to our state dict:
a declarative name map, an explicit list of Conv1D weights to transpose, and a check of every key
and shape. Nothing is guessed and nothing is silently initialised. Files are read with safetensors
(memory-mapped); pickle checkpoints are refused, never opened.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import PRESETS, ModelConfig
from .tokenizer import load_tokenizer, save_tokenizer

if TYPE_CHECKING:
    from .model import HookedTransformer

# HF name (inside `h.{i}.`) -> our name (inside `blocks.{i}.`).
BLOCK_NAME_MAP = {
    "ln_1.weight": "ln1.weight",
    "ln_1.bias": "ln1.bias",
    "attn.c_attn.weight": "attn.qkv.weight",
    "attn.c_attn.bias": "attn.qkv.bias",
    "attn.c_proj.weight": "attn.out.weight",
    "attn.c_proj.bias": "attn.out.bias",
    "ln_2.weight": "ln2.weight",
    "ln_2.bias": "ln2.bias",
    "mlp.c_fc.weight": "mlp.fc_in.weight",
    "mlp.c_fc.bias": "mlp.fc_in.bias",
    "mlp.c_proj.weight": "mlp.fc_out.weight",
    "mlp.c_proj.bias": "mlp.fc_out.bias",
}
TOP_NAME_MAP = {
    "wte.weight": "embed.weight",
    "wpe.weight": "pos_embed.weight",
    "ln_f.weight": "ln_final.weight",
    "ln_f.bias": "ln_final.bias",
}
# GPT-2's Conv1D stores weights as [in, out]; nn.Linear wants [out, in].
CONV1D_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Causal-mask buffers that old checkpoints saved; they hold no learned state.
MASK_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json", "vocab.json",
             "merges.txt", "tokenizer_config.json", "special_tokens_map.json"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class CheckpointError(ValueError):
    """A checkpoint that does not match what its config promises, or that cannot be read safely."""


def hf_name_map(cfg: ModelConfig) -> dict[str, str]:
    """Every HF GPT-2 parameter name (without the `transformer.` prefix) -> our name."""
    names = dict(TOP_NAME_MAP)
    for i in range(cfg.n_layers):
        names.update({f"h.{i}.{hf}": f"blocks.{i}.{ours}" for hf, ours in BLOCK_NAME_MAP.items()})
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "unembed.weight"
    return names


def _is_transposed(hf_name: str) -> bool:
    return hf_name.endswith(CONV1D_TRANSPOSED)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter shapes, from a model built on the meta device (no memory, no init)."""
    from .model import HookedTransformer

    with torch.device("meta"):
        model = HookedTransformer(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def convert_hf_state_dict(raw: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors -> our state dict. Accepts keys with or without `transformer.`, with or without
    the mask buffers, and `lm_head.weight` present or tied. Any unknown, missing or misshapen key raises."""
    stripped: dict[str, torch.Tensor] = {}
    for key, tensor in raw.items():
        name = key.removeprefix("transformer.")
        if name in stripped:
            raise CheckpointError(f"checkpoint holds both {name!r} and 'transformer.{name}'")
        if MASK_BUFFER.match(name):
            continue
        stripped[name] = tensor
    lm_head = stripped.pop("lm_head.weight", None) if cfg.tie_word_embeddings else None

    name_map = hf_name_map(cfg)
    unexpected = sorted(set(stripped) - set(name_map))
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} tensor(s) that a GPT-2 with n_layers={cfg.n_layers} does not: "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    missing = sorted(set(name_map) - set(stripped), key=lambda n: list(name_map).index(n))
    if missing:
        raise CheckpointError(f"checkpoint is missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    shapes = expected_shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    for hf, ours in name_map.items():
        tensor = stripped[hf]
        if _is_transposed(hf):
            tensor = tensor.T
        if tuple(tensor.shape) != shapes[ours]:
            want = shapes[ours][::-1] if _is_transposed(hf) else shapes[ours]
            got = tuple(stripped[hf].shape)
            raise CheckpointError(f"tensor {hf!r} has shape {got}, but config.json implies {want}")
        state[ours] = tensor.contiguous() if _is_transposed(hf) else tensor
    if cfg.tie_word_embeddings:
        if lm_head is not None and (lm_head.shape != state["embed.weight"].shape or not torch.equal(lm_head, state["embed.weight"])):
            raise CheckpointError("config says tie_word_embeddings=true, but lm_head.weight differs from wte.weight")
        state["unembed.weight"] = state["embed.weight"]
    return state


def to_hf_state_dict(model: "HookedTransformer") -> dict[str, torch.Tensor]:
    """The inverse of `convert_hf_state_dict`, with GPT2LMHeadModel's `transformer.` prefix."""
    ours = model.state_dict()
    out = {}
    for hf, name in hf_name_map(model.cfg).items():
        tensor = ours[name].detach()
        tensor = tensor.T if _is_transposed(hf) else tensor
        key = hf if hf == "lm_head.weight" else f"transformer.{hf}"
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


def resolve_model_folder(name_or_path: str | os.PathLike) -> Path:
    """A local folder as is; a hub name (`gpt2`, `openai-community/gpt2`) through the local HF cache,
    downloading only when the network allows."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    text = str(name_or_path)
    if path.exists():
        raise NotADirectoryError(f"{text} is a file; pass the folder that holds config.json and the weights")
    if not _HUB_ID.match(text) or text.startswith((".", "~")):
        raise FileNotFoundError(f"no folder at {text}; pass a folder in the Hugging Face GPT-2 layout or a hub name")
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
    candidates = [name] + ([f"openai-community/{name}"] if name in PRESETS else [])
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


def load_pretrained(cls: type["HookedTransformer"], name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> "HookedTransformer":
    folder = resolve_model_folder(name_or_path)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{folder} has no config.json; expected the Hugging Face GPT-2 layout")
    cfg = ModelConfig.from_json(config_file, name=str(name_or_path))
    state = convert_hf_state_dict(read_safetensors(folder), cfg)
    return _assemble(cls, cfg, state, load_tokenizer(folder), dtype, device)


def from_hf(cls: type["HookedTransformer"], hf_model: torch.nn.Module, tokenizer=None) -> "HookedTransformer":
    cfg = ModelConfig.from_hf_config(hf_model.config, name=getattr(hf_model.config, "name_or_path", "") or "custom")
    param = next(hf_model.parameters())
    state = convert_hf_state_dict({k: v.detach() for k, v in hf_model.state_dict().items()}, cfg)
    return _assemble(cls, cfg, state, tokenizer, param.dtype, param.device)


def _assemble(cls, cfg, state, tokenizer, dtype, device) -> "HookedTransformer":
    with torch.device("meta"):
        model = cls(cfg, tokenizer=tokenizer)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.eval()


def save_pretrained(model: "HookedTransformer", folder: str | os.PathLike) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.to_hf_dict(), indent=2) + "\n", encoding="utf-8")
    save_file(to_hf_state_dict(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
    # A stale shard index would take precedence over the file just written.
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    if model.tokenizer is not None:
        save_tokenizer(model.tokenizer, folder)

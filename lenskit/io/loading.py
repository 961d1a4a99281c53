"""Weights in and out of each family's Hugging Face layout.

Converting a checkpoint is a pure function from a flat name -> tensor mapping (and our parameter
shapes, read from a model built on the meta device) to our state dict: the family's declarative name
map and reshape list (layouts.py, found through the registry in families.py), and a check of every key, shape, dtype and value. Nothing is guessed and nothing is silently initialised. Files are read with safetensors
(memory-mapped, and watched for in-place edits: lenskit.io.mapped); pickle checkpoints are refused, never
opened. Every file is checked to be a regular file first (lenskit.io.files). Finding the folder (an embedded
model, a local folder, the hub cache) is lenskit.io.hub's; placing the weights on devices is lenskit.placement's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import ModelConfig
from ..devices import auto_dtype, is_auto, parse_device, parse_dtype  # noqa: F401 - parse_* re-exported for older imports
from ..families import family_of
from ..placement import Placement, resolve_placement
from ..processing import process_weights
from .files import check_output_file, check_regular_file, read_json_object

# Where a model's folder is (embedded, local or the hub cache): lenskit.io.hub, re-exported for older imports.
from .hub import EMBEDDED_MODELS, embedded_model_folder, model_label, resolve_hub_file, resolve_model_folder  # noqa: F401
from .mapped import WeightFiles
from .mxfp4 import check_quantization_config, dequantize_checkpoint
from .tokenizer import TOKENIZER_FILES, load_tokenizer, save_tokenizer

if TYPE_CHECKING:
    from ..model import HookedTransformer



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
    """Every parameter shape of `cls(cfg)`, from one-block models on the meta device: blocks of one kind (a
    mixture of experts or a dense MLP) have equal shapes, so a config claiming thousands of layers is checked
    against the files before anything large is built."""
    if cfg.block.d_per_layer is not None or cfg.block.n_kv_shared_layers:  # Gemma 4's: shapes that one block cannot show, e.g.
        with torch.device("meta"):  # a sharing block needs its source; n_layers was checked against the files
            return model_shapes(cls(cfg))

    def kind(i: int) -> tuple[bool, str]:  # what a block's shapes depend on: its MLP and its token mixer (linear attention)
        return cfg.is_moe_layer(i), cfg.layer_type(i)

    blocks: dict[tuple[bool, str], dict[str, tuple[int, ...]]] = {}  # kind -> one block's shapes
    for moe, mixer in {kind(i) for i in range(cfg.n_layers)}:
        one_block = cfg.replace(n_layers=1, dense_layers=() if moe or cfg.moe.n_experts is None else (0,),
                                layer_types=None if cfg.layer_types is None else (mixer,))
        with torch.device("meta"):
            one = model_shapes(cls(one_block))
        blocks[moe, mixer] = {k.removeprefix("blocks.0."): v for k, v in one.items() if k.startswith("blocks.0.")}
    shapes = {k: v for k, v in one.items() if not k.startswith("blocks.")}
    shapes.update({f"blocks.{i}.{k}": v for i in range(cfg.n_layers) for k, v in blocks[kind(i)].items()})
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
        name = layout.unprefixed(key)
        name = layout.aliases.get(name, name)
        if name in stripped:
            raise CheckpointError(f"checkpoint holds {name!r} twice, under {key!r} and another spelling (prefix or alias)")
        if layout.is_buffer(name) or layout.is_unread(name, cfg):  # e.g. Gemma 4's unused shared k/v projections
            continue
        check_dtype(key, tensor)  # before the key checks: a quantised file's extra scales are not the real cause
        stripped[name] = tensor
    stripped = layout.split_fused(stripped, cfg)  # MoE experts in transformers 5's fused 3-D spelling -> per expert
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


# The dtypes a checkpoint may store weights in: the three lenskit computes in, and float64 (converted on load).
# float8, float4 and packed-integer (int4 in uint8/int32) tensors are quantised weights, refused by name.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_dtype(name: str, tensor: torch.Tensor) -> None:
    """A stored weight must be in a dtype lenskit computes in; anything else is refused, naming the tensor."""
    if tensor.dtype in WEIGHT_DTYPES:
        return
    kind = "a quantised (float8 / float4) dtype" if tensor.dtype.is_floating_point else "not floating point"
    raise CheckpointError(f"tensor {name!r} has dtype {tensor.dtype}, {kind}; weights must be floating point: "
                          "float32, bfloat16, float16 or float64 (quantised checkpoints, float8, int4 or packed "
                          "integers, are not supported: dequantise first, e.g. save a bfloat16 copy with transformers)")


def check_values(name: str, tensor: torch.Tensor, check_finite: bool = True) -> None:
    """A weight must be in a dtype lenskit computes in, and finite; a NaN or inf would poison every forward silently."""
    check_dtype(name, tensor)
    if not check_finite:
        return
    # One reduction instead of an elementwise mask: a NaN or inf anywhere makes the sum non-finite. It allocates
    # nothing the size of the tensor, and reads a memory-mapped file's pages as file pages (not anonymous memory).
    # A sum can also overflow on finite values (fp16 above 65504), so only then is every element looked at.
    if not bool(torch.isfinite(tensor.sum())) and not bool(torch.isfinite(tensor).all()):
        raise CheckpointError(f"tensor {name!r} holds NaN or inf values; the checkpoint is corrupt or was saved after training diverged")


def _converted(name: str, stored: torch.Tensor, converted: torch.Tensor, check_finite: bool) -> torch.Tensor:
    """`converted` (`stored` in the model's dtype), refused if the conversion made a finite weight inf or NaN: a value
    past float16's 65504 becomes inf, and every logit NaN. `stored` was checked finite already."""
    if not check_finite or converted.dtype == stored.dtype or converted.dtype.itemsize >= stored.dtype.itemsize:
        return converted
    if bool(torch.isfinite(converted.sum())) or bool(torch.isfinite(converted).all()):
        return converted
    largest = float(stored.detach().abs().max())
    holds = [n for n, d in (("bfloat16", torch.bfloat16), ("float32", torch.float32)) if torch.finfo(d).max >= largest]
    raise CheckpointError(f"tensor {name!r} holds {largest:.6g}, past {str(converted.dtype).removeprefix('torch.')}'s "
                          f"largest value ({torch.finfo(converted.dtype).max:.6g}), so converting it gives inf; load with "
                          f"dtype={' or '.join(repr(h) for h in holds or ['float64'])} instead")


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
    return layout.join_fused(out, cfg, layout.prefix)  # experts fused where the family's files know no other spelling


# ------------------------------------------------------------------ files
def checkpoint_files(folder: Path) -> tuple[list[Path], dict | None]:
    """The safetensors files of a checkpoint folder (one file, or the shards its index names, each checked to
    be a regular file) and the index's weight map (None for a single file)."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if os.path.lexists(index):
        data = read_json_object(index, what="a safetensors index (a JSON object with a 'weight_map')")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map' object)")
        values = list(weight_map.values())
        for shard in values:
            if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
                raise CheckpointError(f"{index} names shard {shard!r}; shards must be .safetensors files in the same folder")
        files = [folder / s for s in sorted(set(values))]
    elif os.path.lexists(single):
        files, weight_map = [single], None
    else:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")] + [p.name for p in folder.glob("*.ckpt")]
        found = f"; found {sorted(pickles)}, which lenskit refuses to unpickle" if pickles else ""
        raise CheckpointError(
            f"{folder} has no model.safetensors or model.safetensors.index.json{found}. Convert the checkpoint "
            "to safetensors with a tool you trust, e.g. transformers' save_pretrained(..., safe_serialization=True)"
        )
    for file in files:
        if not os.path.lexists(file):
            raise CheckpointError(f"shard {file.name} listed in {index.name} does not exist in {folder}")
        check_regular_file(file, "a safetensors weights file")
    return files, weight_map


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint, memory-mapped."""
    files, weight_map = checkpoint_files(folder)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        key = None
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key in tensors:
                        raise CheckpointError(f"tensor {key!r} appears in more than one shard")
                    tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError, TypeError, KeyError) as e:
            if isinstance(e, CheckpointError):
                raise
            where = f" (reading tensor {key!r})" if key is not None else ""
            detail = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{file} is not a readable safetensors file (truncated or corrupt?){where}: {detail}") from e
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise CheckpointError(f"{folder / 'model.safetensors.index.json'} lists tensor(s) that no shard holds: {absent[:5]}")
    return tensors


def load_pretrained(cls: type["HookedTransformer"], name_or_path: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: str | torch.device | None = None, check_finite: bool = True,
                    mmap: bool = True, device_map=None, max_memory=None, **processing: bool) -> "HookedTransformer":
    """See `HookedTransformer.from_pretrained`. With `mmap`, weights already in `dtype` on the CPU stay
    memory-mapped, and the files they map are watched (lenskit.io.mapped) before every forward."""
    if device is not None and device_map is not None:
        raise ValueError(f"pass device={device!r} or device_map, not both (a device map names every part's device)")
    auto = is_auto(dtype)
    dtype = parse_dtype(dtype, auto=torch.float32)  # a bad name is refused before anything is read
    device = parse_device(device)
    folder = resolve_model_folder(name_or_path)
    config_file = folder / "config.json"
    if not os.path.lexists(config_file):
        raise FileNotFoundError(f"{folder} has no config.json; expected a Hugging Face model folder")
    config = read_json_object(config_file, what="a Hugging Face config.json (a JSON object)")
    if auto:  # a device map places weights on accelerators: the checkpoint's dtype there, as on one GPU
        dtype = auto_dtype(config, accelerated=device.type != "cpu" or device_map is not None)
    files = WeightFiles(checkpoint_files(folder)[0]) if mmap else WeightFiles()
    raw = read_safetensors(folder)
    files.confirm()
    # The config's layer count is checked against the blocks the tensor names hold before anything scales with it;
    # its quantization_config is refused unless it is MXFP4 in a family that has it (gpt-oss).
    cfg = ModelConfig.from_hf_config(config, name=model_label(name_or_path, folder), tensor_names=raw)
    if check_quantization_config(config):
        raw = dequantize_checkpoint(raw, dtype)
    placement = resolve_placement(cls, cfg, device, device_map, max_memory, dtype)
    for used in {placement.embed, placement.readout, placement.main, *placement.blocks}:
        parse_device(str(used), "device_map")  # each device the map names can be used by this torch, before any weight moves
    model = _assemble(cls, cfg, raw, load_tokenizer(folder), dtype, placement, check_finite, copy=not mmap)
    if device_map is not None:
        model.placement = placement
    if files and shares_memory(model, raw):
        model.weight_files = files  # checked at the start of every forward
    else:
        files.close()  # every weight was copied (another dtype or device): the files no longer matter
    if processing:  # fold_ln=..., as TransformerLens (lenskit.processing); processed tensors are new, never the file's
        model = process_weights(model, **processing, inplace=True)
    return model


def shares_memory(model: torch.nn.Module, raw: Mapping[str, torch.Tensor]) -> bool:
    """Whether any of the model's tensors lives in the storage of a tensor of `raw` (a view of the mapped file)."""
    stored = {t.untyped_storage().data_ptr() for t in raw.values() if t.device.type == "cpu"}
    return any(t.untyped_storage().data_ptr() in stored for t in model.state_dict().values() if t.device.type == "cpu")


def from_hf(cls: type["HookedTransformer"], hf_model: torch.nn.Module, tokenizer=None) -> "HookedTransformer":
    cfg = ModelConfig.from_hf_config(hf_model.config, name=getattr(hf_model.config, "name_or_path", "") or "custom")
    param = next(hf_model.parameters())
    raw = {k: v.detach() for k, v in hf_model.state_dict().items()}
    return _assemble(cls, cfg, raw, tokenizer, param.dtype, param.device)


def _assemble(cls, cfg, raw, tokenizer, dtype, device: torch.device | Placement, check_finite: bool = True,
              copy: bool = False) -> "HookedTransformer":
    """Build on the meta device, convert the checkpoint against its shapes, then assign the tensors, each to its
    unit's device: a checkpoint already in `dtype` on the CPU is used in place (memory-mapped), not copied, unless
    `copy`."""
    state = convert_hf_state_dict(raw, cfg, expected_shapes(cls, cfg), check_finite)
    with torch.device("meta"):
        model = cls(cfg, tokenizer=tokenizer)
    placement = device if isinstance(device, Placement) else Placement.single(device, cfg.n_layers)
    state = {k: _converted(k, v, v.to(device=placement.device_of(k), dtype=dtype, copy=copy), check_finite)
             for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model.eval()


def save_pretrained(model: "HookedTransformer", folder: str | os.PathLike) -> None:
    """The family's Hugging Face folder: config.json, model.safetensors and the tokenizer files. Both are
    built before anything is written, so a family or config that cannot be saved leaves the folder as it was."""
    if model.processing:  # the layout cannot say so: the saved folder would read back as raw weights
        raise ValueError(f"this model's weights are processed ({', '.join(model.processing)}), which a Hugging Face "
                         "folder cannot record; save the raw model and process it after loading "
                         "(from_pretrained(..., fold_ln=True, ...))")
    config = model.cfg.to_hf_dict()
    tensors = to_hf_state_dict(model.state_dict(), model.cfg)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", *TOKENIZER_FILES):  # a FIFO there would block the write forever
        check_output_file(folder / name, "a model file")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # A stale shard index would take precedence over the file just written.
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    if model.tokenizer is not None:
        save_tokenizer(model.tokenizer, folder)

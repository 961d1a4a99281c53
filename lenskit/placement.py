"""Where a model's weights live and where each block computes: one device, a device map across devices, or
blocks offloaded from the CPU.

A device map places whole units, as module prefixes of the model: the embeddings (`embed`, with `pos_embed`),
each block (`blocks.3`, or `blocks` for all of them), and the readout (`ln_final` with `unembed`); `""` is the
whole model. A value is a device (`"cpu"`, `"cuda:1"`, or an int for a CUDA index). A prefix inside a block
(`blocks.3.attn`) would split it and is refused, as is a unit left unplaced.

`"auto"` (also `"balanced"`, `"balanced_low_0"`, `"sequential"`) asks `accelerate`'s planner for the map, with
blocks as modules it must not split, under `max_memory` ({device: bytes or "20GiB"}).

Blocks whose weights stay on the CPU (`"cpu"` in the map) while the map uses an accelerator are *offloaded*: their
weights stay where loading put them (memory-mapped from the checkpoint) and are copied to the main device (the
map's first accelerator) for the block's forward only, one block at a time. So a model larger than the GPU runs
on it, slowly. The embeddings and the readout compute where they are placed.

The residual stream moves to each block's device at the block boundary, so hooks see each tensor on its block's
device; the readout moves its input to its own device, so every lens reads out there.

>>> plan_device_map(HookedTransformer, ModelConfig.from_name("llama-3.1-8b"), "auto", {0: "10GiB", 1: "10GiB", "cpu": "64GiB"})
{'embed': device(type='cuda', index=0), 'blocks.0': ..., 'ln_final': ..., 'unembed': ...}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn
from torch.func import functional_call

if TYPE_CHECKING:
    from .config import ModelConfig
    from .pieces.forward_state import ForwardState

AUTO = ("auto", "balanced", "balanced_low_0", "sequential")
_BLOCK = re.compile(r"blocks\.(\d+)")


@dataclass(frozen=True)
class Placement:
    """Each unit's device, and which blocks are offloaded (their weights on the CPU, computed on `main`)."""

    embed: torch.device
    blocks: tuple[torch.device, ...]  # where each block's weights live
    readout: torch.device
    main: torch.device  # where offloaded blocks compute
    offloaded: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def single(cls, device: torch.device, n_layers: int) -> "Placement":
        return cls(device, (device,) * n_layers, device, device)

    def device_of(self, name: str) -> torch.device:
        """The device of our state-dict entry `name` (e.g. "blocks.3.attn.qkv.weight")."""
        unit = _unit_of(name)
        if unit == "readout":
            return self.readout
        return self.embed if unit == "embed" else self.blocks[int(unit.split(".")[1])]

    def compute_device(self, layer: int) -> torch.device:
        return self.main if layer in self.offloaded else self.blocks[layer]

    def run(self, layer: int, block: nn.Module, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        """Block `layer`'s forward on its compute device, with the forward's `state` (lenskit.pieces.forward_state):
        the stream [batch, pos, d_model] moves there first, and an offloaded block's weights are copied there for this
        call only."""
        device = self.compute_device(layer)
        x = x.to(device, non_blocking=True)
        if layer not in self.offloaded:
            return block(x, state)
        weights = {name: t.to(device, non_blocking=True) for name, t in chain(block.named_parameters(), block.named_buffers())}
        return functional_call(block, weights, (x, state), tie_weights=False)

    @property
    def is_single(self) -> bool:
        return not self.offloaded and len({self.embed, self.readout, *self.blocks}) == 1

    def table(self) -> list[tuple[str, str, str]]:
        """(unit, weights' device, compute device) rows, consecutive blocks alike merged: what `lenskit info` prints."""
        rows = [("embed", str(self.embed), str(self.embed))]
        start = 0
        for i in range(1, len(self.blocks) + 1):
            if i == len(self.blocks) or (self.blocks[i], self.compute_device(i)) != (self.blocks[start], self.compute_device(start)):
                name = f"blocks.{start}" if i - 1 == start else f"blocks.{start}-{i - 1}"
                rows.append((name, str(self.blocks[start]), str(self.compute_device(start))
                             + (" (offloaded)" if start in self.offloaded else "")))
                start = i
        rows.append(("ln_final, unembed", str(self.readout), str(self.readout)))
        return rows


def _unit_of(name: str) -> str:
    """"embed", "blocks.{i}" or "readout" for a state-dict entry or module prefix (Gemma 4's per-layer inputs are
    computed with the embedding, from the tokens)."""
    if name.split(".")[0] in ("embed", "pos_embed", "per_layer_inputs"):
        return "embed"
    if name.split(".")[0] in ("ln_final", "unembed"):
        return "readout"
    match = _BLOCK.match(name)
    if match is None:
        raise ValueError(f"device_map names {name!r}, which is not a part of the model; expected '', 'embed', "
                         "'pos_embed', 'blocks', 'blocks.<i>', 'ln_final' or 'unembed'")
    return match.group(0)


def parse_map_device(value: Any, where: str) -> torch.device:
    """A device map's value: a device string or an int (CUDA index); disk offload is not implemented."""
    if isinstance(value, bool) or not isinstance(value, (int, str, torch.device)):
        raise ValueError(f"device_map[{where!r}]={value!r}: expected a device such as 'cpu', 'cuda:0' or 0")
    if value == "disk":
        raise ValueError(f"device_map[{where!r}]='disk': offload to disk is not implemented; give the CPU more "
                         "max_memory (weights on the CPU stay memory-mapped from the checkpoint) or use more GPUs")
    try:
        return torch.device(f"cuda:{value}" if isinstance(value, int) else value)
    except RuntimeError:
        raise ValueError(f"device_map[{where!r}]={value!r} is not a device torch knows; expected e.g. 'cpu', "
                         "'cuda:0' or 0") from None


def placement_from_map(device_map: Mapping[str, Any], n_layers: int) -> Placement:
    """The placement a device map {module prefix: device} describes; a prefix that is not a unit or a run of
    them, a split block, a unit left unplaced, or parts of one unit on two devices are refused by name."""
    if not isinstance(device_map, Mapping) or not device_map:
        raise ValueError(f"device_map must be {' / '.join(map(repr, AUTO))} or a non-empty {{module prefix: device}} dict, "
                         f"got {device_map!r}")
    placed: dict[str, torch.device] = {}  # every unit part: "embed", "pos_embed", "blocks.{i}", "ln_final", "unembed"
    parts = ["embed", "pos_embed", "per_layer_inputs", *(f"blocks.{i}" for i in range(n_layers)), "ln_final", "unembed"]
    for prefix in sorted(device_map, key=lambda p: (p != "", p.count("."), p)):  # the most specific prefix wins
        if not isinstance(prefix, str):
            raise ValueError(f"device_map key {prefix!r} must be a module prefix such as 'blocks.3'")
        device = parse_map_device(device_map[prefix], prefix)
        if prefix in ("", "blocks"):
            covered = [p for p in parts if prefix == "" or p.startswith("blocks.")]
        elif prefix in parts:
            covered = [prefix]
        else:
            match = _BLOCK.match(prefix)
            if match is not None and int(match.group(1)) < n_layers and prefix != match.group(0):
                raise ValueError(f"device_map[{prefix!r}] splits block {match.group(1)}; a block is placed whole: "
                                 f"use {match.group(0)!r}")
            _unit_of(prefix)  # not a part of the model at all: refused there
            raise ValueError(f"device_map names {prefix!r}, but the model has {n_layers} blocks (blocks.0 to "
                             f"blocks.{n_layers - 1})")
        placed.update({p: device for p in covered})
    missing = [p for p in parts if p not in placed and p not in ("pos_embed", "per_layer_inputs")]
    if missing:
        raise ValueError(f"device_map leaves {_runs(missing)} unplaced; give every block and the embeddings and "
                         "readout a device (\"\" places everything not named)")
    embed, readout = placed["embed"], placed["ln_final"]
    for part, unit, device in (("pos_embed", "embed", embed), ("per_layer_inputs", "embed", embed),
                               ("unembed", "ln_final", readout)):
        if part in placed and placed[part] != device:
            raise ValueError(f"device_map puts {part!r} on {placed[part]} but {unit!r} on {device}; they are one "
                             "unit and compute together: give them one device")
    blocks = tuple(placed[f"blocks.{i}"] for i in range(n_layers))
    accelerators = [d for d in (embed, *blocks, readout) if d.type != "cpu"]
    main = accelerators[0] if accelerators else torch.device("cpu")
    offloaded = frozenset(i for i, d in enumerate(blocks) if d.type == "cpu" and main.type != "cpu")
    return Placement(embed, blocks, readout, main, offloaded)


def _runs(parts: list[str]) -> str:
    return ", ".join(parts) if len(parts) <= 4 else f"{', '.join(parts[:3])} ... {parts[-1]} ({len(parts)} parts)"


def parse_max_memory(max_memory: Mapping[Any, Any] | str | None) -> dict[int | str, int | str] | None:
    """{device: budget} in accelerate's form (CUDA devices as ints); a string "cuda:0=20GiB,cpu=64GiB" is accepted."""
    if max_memory is None:
        return None
    if isinstance(max_memory, str):
        pairs = [item.partition("=") for item in max_memory.split(",") if item.strip()]
        if not pairs or any(not sep or not key.strip() or not value.strip() for key, sep, value in pairs):
            raise ValueError(f"max_memory={max_memory!r}: expected DEVICE=SIZE pairs such as 'cuda:0=20GiB,cpu=64GiB'")
        max_memory = {key.strip(): value.strip() for key, _, value in pairs}
    out: dict[int | str, int | str] = {}
    for key, budget in max_memory.items():
        device = parse_map_device(key, f"max_memory {key}")
        out[(device.index or 0) if device.type == "cuda" else device.type] = budget
    return out


def plan_device_map(model_class: type[nn.Module], cfg: "ModelConfig", device_map: str,
                    max_memory: Mapping[Any, Any] | str | None = None,
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.device]:
    """accelerate's plan for `model_class(cfg)` (`lenskit.HookedTransformer`, built on the meta device, nothing
    allocated): {module prefix: device}, blocks whole. A budget in `max_memory` too small for one block is refused,
    naming the device and the block's size. The class is passed in because the model's loading calls this."""
    from accelerate import infer_auto_device_map  # an optional dependency, needed only for "auto"
    from accelerate.utils import get_balanced_memory

    if device_map not in AUTO:
        raise ValueError(f"device_map={device_map!r}: expected one of {AUTO} or a {{module prefix: device}} dict")
    # Planned untied: accelerate 1.x fails on an embedding tied to a module placed after it. The unembedding then
    # counts twice, which errs on the safe side, and is put back with the embedding below.
    with torch.device("meta"):
        model = model_class(cfg.replace(tie_word_embeddings=False))
    budget = parse_max_memory(max_memory)
    block_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * dtype.itemsize
    for device, size in (budget or {}).items():
        if _bytes(size) < block_bytes:
            name = f"cuda:{device}" if isinstance(device, int) else device
            raise ValueError(f"max_memory {name}={size} cannot hold one block ({block_bytes / 2**20:,.1f} MiB in "
                             f"{str(dtype).removeprefix('torch.')}); give it more or leave it out of max_memory")
    no_split = sorted({type(b).__name__ for b in model.blocks})
    if device_map != "sequential" and not budget:
        budget = get_balanced_memory(model, max_memory=budget, no_split_module_classes=no_split, dtype=dtype,
                                     low_zero=device_map == "balanced_low_0")
    planned = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split, dtype=dtype)
    owners = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters()}
    plan = {prefix: parse_map_device(device, prefix) for prefix, device in planned.items()
            if prefix == "" or any(o == prefix or o.startswith(prefix + ".") for o in owners)}  # hook points own nothing
    if cfg.tie_word_embeddings:
        embed = placement_from_map(plan, cfg.n_layers).embed
        plan.update({"ln_final": embed, "unembed": embed})
    return plan


def _bytes(size: int | str) -> int:
    from accelerate.utils import convert_file_size_to_int

    try:
        return convert_file_size_to_int(size)
    except ValueError:
        raise ValueError(f"max_memory size {size!r}: expected bytes or a size such as '20GiB' or '500MB'") from None


def resolve_placement(model_class: type[nn.Module], cfg: "ModelConfig", device: torch.device,
                      device_map: str | Mapping[str, Any] | None, max_memory: Mapping[Any, Any] | str | None,
                      dtype: torch.dtype) -> Placement:
    """`from_pretrained`'s placement for `model_class(cfg)`: all on `device`, or the map's (planned by accelerate for
    "auto")."""
    if device_map is None:
        if max_memory is not None:
            raise ValueError("max_memory is a budget for device_map='auto'; pass device_map too")
        return Placement.single(device, cfg.n_layers)
    if isinstance(device_map, str):
        device_map = plan_device_map(model_class, cfg, device_map, max_memory, dtype)
    placement = placement_from_map(device_map, cfg.n_layers)
    if cfg.tie_word_embeddings and placement.embed != placement.readout:
        raise ValueError(f"the embeddings are tied to the unembedding, so 'embed' and 'unembed' share one tensor, but "
                         f"the device map puts them on {placement.embed} and {placement.readout}; give them one device")
    return placement

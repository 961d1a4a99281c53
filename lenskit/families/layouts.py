"""Hugging Face checkpoint layouts (`Layout`): key prefix, a declarative name map, the tensors that need
reshaping, and the buffers old checkpoints carry that hold no learned state; and the layouts several families
share (Llama's names, Gemma's, routed experts'). A family's own layout is in its module (`lenskit.families.gpt2`).

Names inside a block are written once per family as `ours -> theirs`; the full map is generated from
our own state-dict keys, so a bias the config turns off is simply not expected. A block-local name may
be a template whose `{placeholders}` stand for indices inside the block: one entry
`"mlp.experts.{e}.gate.weight": "mlp.experts.{e}.gate_proj.weight"` names every expert's gate. Which
`model_type` stores its weights in which layout is its family record's business.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterable, Iterator, Mapping

import torch

LLAMA_BLOCK = {
    "ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight",
    **{f"attn.qkv.{x}.{p}": f"self_attn.{x}_proj.{p}" for x in "qkv" for p in ("weight", "bias")},
    "attn.out.weight": "self_attn.o_proj.weight", "attn.out.bias": "self_attn.o_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
    **{f"mlp.{ours}.{p}": f"mlp.{theirs}.{p}" for ours, theirs in (("gate", "gate_proj"), ("fc_in", "up_proj"),
                                                                    ("fc_out", "down_proj")) for p in ("weight", "bias")},
}


# Mixture-of-experts blocks: the router and each expert's three projections, as the hub stores them.
_MOE_BLOCK = {
    **LLAMA_BLOCK, "mlp.router.weight": "mlp.gate.weight",
    **{f"mlp.experts.{{e}}.{ours}.weight": f"mlp.experts.{{e}}.{theirs}.weight"
       for ours, theirs in (("gate", "gate_proj"), ("fc_in", "up_proj"), ("fc_out", "down_proj"))},
}


def _transposed(t: torch.Tensor, cfg) -> torch.Tensor:
    """A view, not a copy: a transposed weight is as fast in F.linear (benchmarks/results.md, "Big checkpoints")
    and lets a memory-mapped checkpoint stay mapped."""
    return t.T


@dataclass(frozen=True)
class Reshape:
    """How a checkpoint stores one of our tensors: `load` turns the stored tensor into ours, `save` is its
    inverse (None: the family cannot be saved), `shape` maps our shape to the stored one."""

    load: Callable[[torch.Tensor, object], torch.Tensor]
    save: Callable[[torch.Tensor, object], torch.Tensor] | None
    shape: Callable[[tuple[int, ...]], tuple[int, ...]] = tuple


TRANSPOSE = Reshape(_transposed, _transposed, lambda shape: tuple(reversed(shape)))

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class FusedExperts:
    """transformers 5's in-memory spelling of a block's experts, which `from_hf` reads from `state_dict()` and which
    a file written from it (safetensors' `save_file(model.state_dict())`) holds: every expert in two 3-D tensors,
    `gate_up` [expert, 2 * d_expert, d_model] (each expert's gate rows, then its up rows) and `down`
    [expert, d_model, d_expert], and the router at `router`. (transformers' own save_pretrained writes the hub's
    per-expert names.) `Layout.split_fused` rewrites these to the layout's per-expert names, as views; where the
    family's files have no other spelling (`only`), `Layout.join_fused` writes them back for saving."""

    gate_up: str = "mlp.experts.gate_up_proj"
    down: str = "mlp.experts.down_proj"
    router: str = "mlp.gate.weight"
    biases: tuple[str, str] | None = None  # the fused biases of gate_up and down, where the experts have biases
    only: bool = False  # the family's own files spell the experts only so (gpt-oss)

    def shapes(self, cfg) -> tuple[tuple[int, ...], ...]:
        """The stored shapes of `gate_up` and `down` (then of `biases`, where there are any) for `cfg`."""
        return (cfg.moe.n_experts, 2 * cfg.moe.d_expert, cfg.d_model), (cfg.moe.n_experts, cfg.d_model, cfg.moe.d_expert)

    def parts(self, gate_up: torch.Tensor, down: torch.Tensor, cfg) -> Iterator[tuple[int, str, torch.Tensor]]:
        """(expert, our projection, its weight [out, in]) for every expert: views, not copies. Another storage order
        (transposed, or gate and up rows interleaved) is a subclass that overrides this and `shapes`."""
        m = cfg.moe.d_expert
        for e in range(cfg.moe.n_experts):
            yield e, "gate", gate_up[e, :m]
            yield e, "fc_in", gate_up[e, m:]
            yield e, "fc_out", down[e]

    def bias_parts(self, gate_up: torch.Tensor, down: torch.Tensor, cfg) -> Iterator[tuple[int, str, torch.Tensor]]:
        """(expert, our projection, its bias [out]) from the fused biases, where `biases` names them."""
        raise NotImplementedError(f"{type(self).__name__} has no fused biases")

    def fuse(self, expert: Callable[[int, str, str], torch.Tensor], cfg) -> dict[str, torch.Tensor]:
        """The inverse of `parts` and `bias_parts`: block-local fused name -> tensor, from `expert(e, projection,
        "weight" or "bias")`. Needed only where `only`."""
        raise NotImplementedError(f"{type(self).__name__} is not the only spelling of its family's experts")



@lru_cache(maxsize=None)
def _template(name: str) -> re.Pattern:
    """`mlp.experts.{e}.gate.weight` -> a pattern for it in which each placeholder is a decimal index."""
    parts = _PLACEHOLDER.split(name)  # literal, placeholder, literal, ...
    return re.compile("".join(re.escape(p) if k % 2 == 0 else rf"(?P<{p}>\d+)" for k, p in enumerate(parts)))


def _lookup(table: Mapping[str, object], local: str) -> tuple[str, dict[str, str]] | None:
    """The entry of `table` that names `local`, with its placeholders' values: an exact name first, else the
    first template that matches the whole of `local`."""
    if local in table:
        return local, {}
    for name in table:
        if "{" in name and (m := _template(name).fullmatch(local)):
            return name, m.groupdict()
    return None


@dataclass(frozen=True)
class Layout:
    """How one family's checkpoint names and stores our parameters."""

    prefix: str  # the base model's prefix, e.g. "model."; keys may come with or without it
    blocks: str  # the block list inside the base model, e.g. "layers"
    top: dict[str, str]  # ours -> theirs, outside the blocks (the unembedding has no prefix)
    block: dict[str, str]  # ours -> theirs, inside one block; names may be templates (see the module docstring)
    reshape: dict[str, Reshape] = field(default_factory=dict)  # block-local ours (as in `block`) -> how it is stored
    buffers: str = r"$^"  # regex, on unprefixed names, of stored buffers to skip
    aliases: dict[str, str] = field(default_factory=dict)  # other spellings -> the file's, e.g. in-memory names
    # other spellings of the prefix: Nemotron-H's files say `backbone.` where transformers' model in memory says `model.`
    other_prefixes: tuple[str, ...] = ()
    fused: FusedExperts | None = None  # the fused 3-D spelling of a MoE block's experts, where transformers has one
    # (unprefixed name, config) -> whether a stored tensor is one that no parameter of this config reads and that
    # transformers drops on load too (Gemma 4's kv-sharing blocks' k/v projections and norms); None: there are none
    unread: Callable[[str, object], bool] | None = None

    def __post_init__(self) -> None:
        for ours, theirs in self.block.items():
            extra = set(_PLACEHOLDER.findall(theirs)) - set(_PLACEHOLDER.findall(ours))
            if extra:
                raise ValueError(f"layout entry {ours!r} -> {theirs!r}: placeholders {sorted(extra)} are missing on our side")
        unknown = sorted(set(self.reshape) - set(self.block))
        if unknown:
            raise ValueError(f"layout reshapes {unknown}, which its block name map does not name")

    def name_map(self, our_keys: Iterable[str], n_layers: int) -> dict[str, str]:
        """theirs (unprefixed, except the unembedding) -> ours, for every key in `our_keys`."""
        out = {}
        for ours in our_keys:
            if ours.startswith("blocks."):
                _, i, local = ours.split(".", 2)
                found = _lookup(self.block, local)
                if found is None:
                    raise KeyError(f"no checkpoint name for our parameter {ours!r} in this layout")
                name, index = found
                out[f"{self.blocks}.{i}.{self.block[name].format(**index)}"] = ours
            else:
                if ours not in self.top:
                    raise KeyError(f"no checkpoint name for our parameter {ours!r} in this layout")
                out[self.top[ours]] = ours
        return out

    def split_fused(self, tensors: Mapping[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
        """`tensors` (unprefixed checkpoint names) with each block's fused experts (see `FusedExperts`) rewritten to
        this layout's per-expert names, as views of the fused tensors (a memory-mapped file stays mapped). A fused
        tensor of the wrong shape, or one without its partners, is refused by name; where the fused spelling is the
        family's only one, so is a MoE block without it."""
        if self.fused is None or cfg.moe.n_experts is None:
            return dict(tensors)
        fused, out = self.fused, dict(tensors)
        if fused.only:
            blocks = [f"{self.blocks}.{i}." for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
        else:
            pattern = re.compile(rf"{re.escape(self.blocks)}\.(\d+)\.{re.escape(fused.gate_up)}")
            blocks = [n[: -len(fused.gate_up)] for n in tensors if pattern.fullmatch(n)]  # "layers.3."
        for block in blocks:
            keys = [block + k for k in (fused.gate_up, fused.down, *(fused.biases or ()))]
            stored = [out.pop(key, None) for key in keys]
            absent = [key for key, t in zip(keys, stored) if t is None]
            if absent:
                have = f"has {keys[0]!r} but not" if stored[0] is not None else "is missing"
                raise ValueError(f"checkpoint {have} {absent[0]!r} (a {cfg.family} MoE block stores its experts in "
                                 f"{[k.removeprefix(block) for k in keys]}); the checkpoint is incomplete")
            for tensor, key, want in zip(stored, keys, fused.shapes(cfg)):
                if tuple(tensor.shape) != want:
                    raise ValueError(f"tensor {key!r} has shape {tuple(tensor.shape)}, but config.json implies {want} "
                                     f"([expert, ...] for {cfg.moe.n_experts} experts of width {cfg.moe.d_expert}); fix the "
                                     "config or the checkpoint")
            split = [(fused.parts(stored[0], stored[1], cfg), "weight")]
            if fused.biases:
                split.append((fused.bias_parts(stored[2], stored[3], cfg), "bias"))
            for parts, kind in split:
                for e, ours, part in parts:
                    name = block + self.block[f"mlp.experts.{{e}}.{ours}.{kind}"].format(e=e)
                    if name in out:  # one tensor in two spellings: which one the checkpoint means is not ours to guess
                        raise ValueError(f"checkpoint holds expert {e} of {block.rstrip('.')!r} twice: as {name!r} and "
                                         f"inside the fused {keys[0]!r}; keep one spelling")
                    out[name] = part
            router = self.block["mlp.router.weight"]
            if router != fused.router and block + fused.router in out:
                if block + router in out:
                    raise ValueError(f"checkpoint holds the router of {block.rstrip('.')!r} twice: as {block + router!r} "
                                     f"and {block + fused.router!r}; keep one spelling")
                out[block + router] = out.pop(block + fused.router)
        return out

    def join_fused(self, tensors: Mapping[str, torch.Tensor], cfg, prefix: str = "") -> dict[str, torch.Tensor]:
        """The inverse of `split_fused` for saving, where the fused spelling is the family's only one: `tensors`
        (names with `prefix`) with each MoE block's per-expert tensors replaced by the fused ones."""
        if self.fused is None or not self.fused.only or cfg.moe.n_experts is None:
            return dict(tensors)
        out = dict(tensors)
        for i in (i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)):
            block = f"{prefix}{self.blocks}.{i}."

            def expert(e: int, ours: str, kind: str) -> torch.Tensor:
                return out.pop(block + self.block[f"mlp.experts.{{e}}.{ours}.{kind}"].format(e=e))

            out.update({block + name: t.contiguous() for name, t in self.fused.fuse(expert, cfg).items()})
        return out

    def reshape_of(self, ours: str) -> Reshape | None:
        """How the checkpoint stores our parameter `ours`; None when as is."""
        if not ours.startswith("blocks."):
            return None
        found = _lookup(self.reshape, ours.split(".", 2)[2])
        return None if found is None else self.reshape[found[0]]

    def stored_shape(self, ours: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape the checkpoint stores our parameter `ours` of shape `shape` in."""
        how = self.reshape_of(ours)
        return tuple(shape) if how is None else how.shape(tuple(shape))

    def to_ours(self, ours: str, stored: torch.Tensor, cfg) -> torch.Tensor:
        """The checkpoint's tensor for our parameter `ours`, as ours."""
        how = self.reshape_of(ours)
        return stored if how is None else how.load(stored, cfg)

    def to_stored(self, ours: str, tensor: torch.Tensor, cfg) -> torch.Tensor:
        """Our parameter `ours` as the checkpoint stores it: the inverse of `to_ours`."""
        how = self.reshape_of(ours)
        if how is None:
            return tensor
        if how.save is None:
            raise ValueError(f"the checkpoint stores {ours!r} through {how.load.__name__}, which has no inverse in "
                             f"{how.load.__module__}; saving this family in its Hugging Face layout is not implemented")
        return how.save(tensor, cfg)

    def block_count(self, names: Iterable[str]) -> int:
        """How many distinct blocks checkpoint tensor `names` (with the base-model prefix or without) hold.
        O(len(names)) whatever a config claims, and a stray huge index counts as one block, not as its value."""
        prefixes = "|".join(re.escape(p) for p in (self.prefix, *self.other_prefixes))
        pattern = re.compile(rf"(?:{prefixes})?{re.escape(self.blocks)}\.(\d+)\.")
        return len({m.group(1) for name in names if (m := pattern.match(name))})

    def unprefixed(self, key: str) -> str:
        """A checkpoint key without the base-model prefix (any of its spellings), if it has one."""
        for prefix in (self.prefix, *self.other_prefixes):
            if key.startswith(prefix):
                return key[len(prefix):]
        return key

    def is_buffer(self, name: str) -> bool:
        """Whether an unprefixed checkpoint name is a stored buffer without learned state."""
        return re.match(self.buffers, name) is not None

    def is_unread(self, name: str, cfg) -> bool:
        """Whether an unprefixed checkpoint name is a tensor `cfg`'s model does not read (see `unread`)."""
        return self.unread is not None and self.unread(name, cfg)


LLAMA = Layout(
    prefix="model.", blocks="layers",
    top={"embed.weight": "embed_tokens.weight", "ln_final.weight": "norm.weight", "unembed.weight": "lm_head.weight"},
    block=LLAMA_BLOCK, buffers=r"^layers\.\d+\.self_attn\.rotary_emb\.inv_freq$",
)
GEMMA = Layout(
    prefix="model.", blocks="layers",
    top={"embed.weight": "embed_tokens.weight", "ln_final.weight": "norm.weight", "unembed.weight": "lm_head.weight"},
    block={**LLAMA_BLOCK, "ln1_post.weight": "post_attention_layernorm.weight",
           "ln2.weight": "pre_feedforward_layernorm.weight", "ln2_post.weight": "post_feedforward_layernorm.weight"},
)
MOE = Layout(prefix="model.", blocks="layers", top=LLAMA.top, block=_MOE_BLOCK, buffers=LLAMA.buffers,
             fused=FusedExperts())  # Qwen3-MoE, OLMoE

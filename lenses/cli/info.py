"""`lenskit info [--model M]`: parameter counts, the per-block split and FLOPs per token of a model."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pandas as pd

import lenskit
from lenskit import accounting
from lenskit.config import ModelConfig
from lenskit.families import FAMILIES
from lenskit.io.files import check_output_file, open_output
from lenskit.io.loading import read_safetensors, resolve_model_folder
from lenskit.pieces.layers import mixer_classes


def model_help() -> str:
    """`--model`'s help: every registered family with its presets, from the registry."""
    presets = "; ".join(f"{t}: {', '.join(f.presets)}" if f.presets else t for t, f in FAMILIES.items())
    embedded = ", ".join(lenskit.EMBEDDED_MODELS)
    return ("an embedded model (" + embedded + "), a model folder, a preset name by model_type (" + presets +
            "; an organisation prefix such as EleutherAI/ is fine) or a hub name in the local Hugging Face cache; "
            "default: the embedded stdlib-gpt2")


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> None:
    p = subparsers.add_parser(
        name, help="parameter and FLOP accounting of a model",
        description="Print a model's parameter counts (per block: attention, MLP, norms; weights and biases "
                    "apart), its non-embedding total and FLOPs per token. Reads only the config (and the checkpoint's "
                    "tensor names, to check the layer count against them), never the weights.",
    )
    p.add_argument("--model", default=None, help=model_help())
    p.add_argument("--n-ctx", type=int, default=None, help="context length for the FLOP count (default: the model's)")
    p.add_argument("--tokens", type=float, default=None, help="also print the training compute 6ND for this many tokens")
    p.add_argument("--csv", default=None, help="write the per-component parameter table to this CSV file")
    p.add_argument("--device-map", default=None, metavar="MAP",
                   help="also print where each block would go: auto, balanced, balanced_low_0 or sequential "
                        "(accelerate's planner; blocks whole, nothing allocated)")
    p.add_argument("--max-memory", default=None, metavar="DEV=SIZE,...",
                   help="the planner's budget per device, e.g. cuda:0=20GiB,cuda:1=20GiB,cpu=64GiB")
    p.add_argument("--dtype", default="auto", metavar="DTYPE",
                   help="the weights' dtype for --device-map: auto (the checkpoint's own, as its config.json says; "
                        "bfloat16 where it says none, as for a preset), float32/fp32, bfloat16/bf16, float16/fp16")
    p.set_defaults(run=run)


def resolve_config(model: str | None) -> tuple[ModelConfig, str, Path | None]:
    """The config of `model`, where it came from and its folder (None for a preset), reading config.json rather
    than the weights: an embedded model, a folder, a preset (by its short name, optionally with an organisation
    prefix), then a hub name in the local Hugging Face cache. A path that does not exist is refused, never read as the preset it ends in."""
    if model in lenskit.EMBEDDED_MODELS:  # a short name means the embedded model, before any folder of that name
        path = resolve_model_folder(model)
    else:
        path = Path(lenskit.DEFAULT_MODEL if model is None else model).expanduser()
    if os.path.lexists(path / "config.json"):  # a FIFO or folder there is refused by name when it is read
        name = "the embedded model" if model is None else (model if model in lenskit.EMBEDDED_MODELS else path.name)
        return _read_config(path, name), f"{path}/config.json", path
    if model is None:
        raise FileNotFoundError(f"the embedded model is missing at {path}; reinstall lenskit or pass --model")
    try:
        return ModelConfig.from_name(model), "preset shapes (no weights needed)", None
    except KeyError:
        pass  # not a preset: a folder, a file, a path that does not exist, or a hub name
    if path.is_dir():
        raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face model folder or a preset name")
    folder = resolve_model_folder(model)  # "no folder at ...", "... is a file", or the hub cache (explaining a miss)
    if not os.path.lexists(folder / "config.json"):
        raise FileNotFoundError(f"{folder} has no config.json; expected a Hugging Face model folder")
    return _read_config(folder, model), f"{model} (Hugging Face cache)", folder


def _read_config(folder: Path, name: str) -> ModelConfig:
    """A folder's config.json, its layer count checked against the checkpoint's tensor names (memory-mapped,
    not read) when the folder holds weights: a config claiming a million blocks over a few is refused at once."""
    has_weights = any((folder / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))
    names = list(read_safetensors(folder)) if has_weights else None
    return ModelConfig.from_json(folder / "config.json", name=name, tensor_names=names)


def print_placement(cfg: ModelConfig, args: argparse.Namespace, folder: Path | None = None) -> None:
    """Where `--device-map` would put each block under `--max-memory`, planned on the meta device."""
    from lenskit.devices import BF16, checkpoint_dtype, parse_dtype
    from lenskit.io.files import read_json_object
    from lenskit.placement import placement_from_map, plan_device_map

    if args.device_map is None:
        raise ValueError("--max-memory is a budget for --device-map; pass --device-map auto too")
    saved = checkpoint_dtype(read_json_object(folder / "config.json", what="a Hugging Face config.json")) if folder else None
    dtype = parse_dtype(args.dtype, auto=saved or BF16, name="--dtype")  # the plan is for accelerators
    placement = placement_from_map(plan_device_map(lenskit.HookedTransformer, cfg, args.device_map, args.max_memory, dtype), cfg.n_layers)
    print(f"\nplacement: --device-map {args.device_map}" + (f" --max-memory {args.max_memory}" if args.max_memory else "")
          + f", {str(dtype).removeprefix('torch.')} weights")
    print(pd.DataFrame(placement.table(), columns=["part", "weights on", "computes on"]).to_string(index=False))


def _count(x: float) -> str:
    return f"{int(x):,}"


def _human(x: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def run(args: argparse.Namespace) -> int:
    if args.csv:  # before any work
        check_output_file(args.csv, "the --csv table", pipe_ok=True)
    from lenskit.devices import BF16, parse_dtype

    parse_dtype(args.dtype, auto=BF16, name="--dtype")  # a bad spelling fails before any work
    cfg, source, folder = resolve_config(args.model)
    summary = accounting.param_summary(cfg)
    block = accounting.block_params(cfg)
    flops = accounting.flops_per_token(cfg, args.n_ctx)
    n_ctx = args.n_ctx or cfg.n_ctx

    print(f"model {cfg.name}  from {source}")
    print(f"  n_layers={cfg.n_layers} d_model={cfg.d_model} n_heads={cfg.n_heads} d_head={cfg.d_head} "
          f"d_mlp={cfg.d_mlp} d_vocab={cfg.d_vocab} n_ctx={cfg.n_ctx} norm={cfg.norm} mlp={cfg.mlp}")
    print(f"  family={cfg.family} n_kv_heads={cfg.n_kv_heads} positions={cfg.positional}"
          + (f" rotary_dim={cfg.rope.dim} base={cfg.rope.base:g} rope_type={cfg.rope.type}" if cfg.positional == "rotary" else "")
          + (f" sliding_window={cfg.sliding_window}" if cfg.sliding_window else "")
          + (" parallel_block" if cfg.parallel_block else "") + (" qk_norm" if cfg.attention.qk_norm else ""))
    extras = [f"norm_placement={cfg.norm_placement}" if cfg.norm_placement != "pre" else "",
              "scale_embed" if cfg.scale_embed else "",
              f"query_pre_attn_scalar={cfg.attention.query_pre_attn_scalar:g}" if cfg.attention.query_pre_attn_scalar else "",
              f"attn_softcap={cfg.attention.softcap:g}" if cfg.attention.softcap else "",
              f"final_softcap={cfg.final_softcap:g}" if cfg.final_softcap else "",
              f"sliding_blocks={cfg.layer_types.count('sliding')}/{cfg.n_layers}" if cfg.layer_types and "sliding" in
              cfg.layer_types else "",
              f"local_rotary_base={cfg.rope.local_base:g}" if cfg.rope.local_base else "",
              f"chunked_blocks={cfg.layer_types.count('chunked')}/{cfg.n_layers} (chunks of {cfg.attention.chunk_size})"
              if cfg.layer_types and "chunked" in cfg.layer_types else "",
              "rotary_adjacent_pairs" if cfg.rope.adjacent_pairs else "", "qk_unit_norm" if cfg.attention.qk_unit_norm else "",
              f"attn_temperature=(floor {cfg.attention.temperature_floor}, scale {cfg.attention.temperature_scale:g})"
              if cfg.attention.temperature_floor else "",
              f"shared_experts={cfg.moe.n_shared_experts}" if cfg.moe.n_shared_experts else "",
              f"no_rotary_blocks={list(cfg.nope_layers)}" if cfg.nope_layers else "",
              f"experts={cfg.moe.n_experts} top_k={cfg.moe.n_experts_per_token} d_expert={cfg.moe.d_expert} routing={cfg.moe.routing}"
              if cfg.moe.n_experts else "",
              f"dense_blocks={list(cfg.moe.dense_layers)}" if cfg.moe.dense_layers else "",
              f"shared_experts={cfg.moe.n_shared_experts}" + (f" (d_shared={cfg.moe.d_shared})" if cfg.moe.d_shared else "")
              + (" sigmoid-gated" if cfg.moe.shared_gate else "") if cfg.moe.n_experts and cfg.moe.n_shared_experts else "",
              (f"scales: embedding={cfg.scales.embedding:g} residual={cfg.scales.residual:g} logits={cfg.scales.logits:g}"
               if (cfg.scales.embedding, cfg.scales.residual, cfg.scales.logits) != (1.0, 1.0, 1.0) else ""),
              f"linear_attention_blocks={cfg.layer_types.count('linear')}/{cfg.n_layers} (Gated DeltaNet: "
              f"{cfg.linear.n_k_heads} q/k heads of {cfg.linear.d_k}, {cfg.linear.n_v_heads} value heads of {cfg.linear.d_v}, "
              f"conv width {cfg.linear.conv_width})" if cfg.layer_types and "linear" in cfg.layer_types else "",
              f"mamba_blocks={cfg.layer_types.count('mamba')}/{cfg.n_layers} (Mamba-2: {cfg.mamba.n_heads} heads of "
              f"{cfg.mamba.d_head}, state {cfg.mamba.d_state}, {cfg.mamba.n_groups} groups, conv width "
              f"{cfg.mamba.conv_width}, chunks of {cfg.mamba.chunk_size})" if cfg.layer_types and "mamba" in cfg.layer_types
              else "",
              f"one_sublayer (mixer-only and {cfg.layer_types.count('mlp')} MLP-only blocks)"
              if cfg.block.one_sublayer and cfg.layer_types else "",
              "attn_output_gate" if cfg.attention.output_gate else "",
              f"per_layer_inputs={cfg.block.d_per_layer} (vocabulary {cfg.block.d_vocab_per_layer})" if cfg.block.d_per_layer else "",
              f"kv_shared_blocks={cfg.block.n_kv_shared_layers} (blocks {cfg.n_layers - cfg.block.n_kv_shared_layers}.."
              f"{cfg.n_layers - 1} read the keys of blocks {sorted({s for s in cfg.kv_source_layers if s is not None})})"
              + (" double_wide_mlp" if cfg.block.double_wide_mlp else "") if cfg.block.n_kv_shared_layers else "",
              "experts_beside_mlp" if cfg.block.experts_beside_mlp else ""]
    if any(extras):
        print("  " + " ".join(e for e in extras if e))

    print("\nparameters")
    shown = summary.copy()
    shown["value"] = [f"{v:.4f}" if isinstance(v, float) else _count(v) for v in shown["value"]]
    shown["human"] = [_human(v) if not isinstance(v, float) else "" for v in summary["value"]]
    print(shown[["value", "human", "note"]].to_string())

    hybrid = cfg.layer_types is not None and "linear" in cfg.layer_types
    shapes = len(accounting.block_kinds(cfg))  # Gemma 4's full and kv-sharing blocks have shapes of their own
    kinds = sorted(set(cfg.layer_types or ()))
    print(f"\nper block (block 0, a {cfg.layer_type(0)} block; the model mixes {', '.join(kinds)} blocks)"
          if cfg.block.one_sublayer or "mamba" in kinds else
          f"\nper block (block 0, a {cfg.layer_type(0)}-attention block; the model mixes linear- and full-attention blocks)"
          if hybrid else f"\nper block (x{cfg.n_layers})" if shapes == 1 else
          f"\nper block (block 0, a {cfg.layer_type(0)}-attention block; the blocks have {shapes} shapes)"
          if not cfg.moe.dense_layers else
          f"\nper block (block 0, a {'MoE' if cfg.is_moe_layer(0) else 'dense'} block; the model mixes MoE and dense blocks)")
    per_block = pd.concat([block, block.sum().to_frame("total").T])
    per_block["share"] = per_block["params"] / block["params"].sum()
    print(per_block.to_string(formatters={"weights": _count, "biases": _count, "params": _count,
                                          "share": "{:.1%}".format}))

    print(f"\nFLOPs per token at n_ctx={n_ctx} (matmuls only; training = 3 x forward)")
    print(flops.to_string(formatters={"forward": _human, "training": _human, "share": "{:.1%}".format}))
    total = float(summary.loc["total", "value"])
    non_emb = float(summary.loc["non_embedding", "value"])
    core = float(flops.loc["attn_core", "forward"])
    print(f"  forward / params = {flops.loc['total', 'forward'] / total:.2f} "
          f"({(flops.loc['total', 'forward'] - core) / total:.2f} without the attention core); "
          f"attention core = {core / (2 * non_emb):.1%} of 2N (N non-embedding), {core / (2 * total):.1%} of 2N (N all)")
    if "linear_core" in flops.index:  # Gated DeltaNet or Mamba-2 blocks, or a Mamba-2 mixer beside attention (Falcon-H1)
        linear = sum(any("linear_core" in m.core_flops(cfg, l, 1) for m in mixer_classes(cfg, l)) for l in range(cfg.n_layers))
        print(f"  linear-time mixers ({linear} of {cfg.n_layers} blocks): linear_core is the same per "
              "token at any context, so its cost is linear in the context; only attn_core (the softmax-attention "
              "blocks) grows with n_ctx")
    if args.tokens is not None:
        print(f"\ntraining compute 6ND for D={args.tokens:.3g} tokens: "
              f"{accounting.six_nd(cfg, args.tokens):.3g} FLOPs (N non-embedding)")
    if args.device_map is not None or args.max_memory is not None:
        print_placement(cfg, args, folder)
    if args.csv:
        with open_output(args.csv, "the --csv table", pipe_ok=True) as f:
            accounting.param_table(cfg).to_csv(f, index=False)
        print(f"\nwrote {args.csv}")
    return 0

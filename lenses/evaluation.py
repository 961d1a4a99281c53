"""Per-layer evaluation of lenses on held-out text: KL to the final output, cross-entropy, entropy, prediction depth.

Two levels, so that figures can carry confidence bands and tables stay small:

- `evaluate_windows`: tidy rows, one per (lens, layer, window), each the mean over that window's tokens.
  Tokens inside one window are correlated, so windows are the unit of the confidence intervals.
- `per_layer` / `evaluate`: one row per layer, lenses side by side (`kl_logit, kl_tuned, ce_logit, ...`),
  in nats per token with bits-per-byte twins (`*_bpb`).

>>> table = evaluate(model, {"logit": LogitLens(model), "tuned": tuned}, heldout_stream, tokens=2**10, ctx=256,
...                  progress=False)
>>> table[["layer", "kl_logit", "kl_tuned"]].round(2)    # an untrained tuned lens reads as the logit lens
   layer  kl_logit  kl_tuned
0      0     ...
6      6      0.00      0.00
>>> sorted(table.attrs["prediction_depth"])     # {"logit": ..., "tuned": ...}: mean over tokens, in layers
['logit', 'tuned']
"""

from __future__ import annotations

from typing import Mapping, Sequence

import pandas as pd
import torch
from tqdm import tqdm  # tqdm.auto warns in kernels without ipywidgets

from lenskit import HookedTransformer
from lenskit.io.data import TokenStream
from lenskit.observe.stream import streams

from . import metrics
from .base import Lens
from .chunks import chunk_rows, cross_term, shifted_stats

METRICS = ("kl", "ce", "entropy", "top1_agree", "settled")
# Logits are worked on a chunk of tokens at a time, in four reused float32 buffers of [rows, d_vocab], as many
# rows as `lenses.chunks.chunk_rows` gives the device. Beyond the model's forward and the cached streams
# ([n_layers + 1, batch, pos, d_model]), evaluation therefore holds four such buffers of logits, whatever the
# number of layers, tokens or lenses (tests/test_evaluation.py measures it on the CPU).
BUFFERS = 4


def _named(lenses: Mapping[str, Lens] | Sequence[Lens]) -> dict[str, Lens]:
    if isinstance(lenses, Mapping):
        return dict(lenses)
    named = {getattr(lens, "name", type(lens).__name__.lower()): lens for lens in lenses}
    if len(named) != len(lenses):
        raise ValueError("two lenses share a name; pass a dict {name: lens} instead")
    return named


@torch.no_grad()  # not inference_mode: tensors a module caches during the run (rotary tables) must stay usable by autograd later
def evaluate_windows(model: HookedTransformer, lenses: Mapping[str, Lens] | Sequence[Lens], windows: torch.Tensor,
                     batch: int = 8, progress: bool = True) -> pd.DataFrame:
    """windows [n_windows, ctx] -> tidy DataFrame, one row per (lens, layer, window):

    - kl: KL(final || lens), nats, mean over the window's ctx positions;
    - ce: cross-entropy of the lens against the next token, nats, mean over the first ctx - 1 positions;
    - entropy: entropy of the lens's distribution, nats;
    - top1_agree: fraction of positions where the lens's top-1 equals the final top-1;
    - settled: fraction of positions whose prediction depth is <= layer. The prediction depth of a token
      is the first layer from which the lens's top-1 stays equal to the final top-1 through the last layer.

    At a stream a lens does not cover (`Lens.covers`), its numbers are NaN and the stream counts as unsettled.

    Every lens takes the same path: its logits for a chunk of tokens at one stream (`Lens.logits_into`),
    then the same statistics. "final" is the model's own readout of the last stream.

    Under torch.distributed (torchrun) every rank calls this with the same windows and scores windows rank,
    rank + world, ...; the rows are gathered, so every rank returns the whole table, in one process's order.
    """
    lenses = _named(lenses)
    for name, lens in lenses.items():
        if lens.model is not model:
            raise ValueError(f"lens {name!r} was built for another model object; build it on the model being evaluated")
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [n_windows, ctx] with ctx >= 2, got shape {tuple(windows.shape)}")
    locations = streams(model.cfg.n_layers)  # the streams after 0..n_layers blocks
    names = [s.hook_name(model.cfg.n_layers) for s in locations]
    rank, world = _distributed()
    mine = range(rank, len(windows), world)  # this process's windows (all of them in one process)
    on_device = windows.to(model.embed.weight.device)  # once: a copy per batch would wait for the device
    parts: dict[str, dict[str, list[torch.Tensor]]] = {name: {k: [] for k in METRICS} for name in lenses}
    for start in tqdm(range(0, len(mine), batch), desc="evaluate", disable=not progress or rank != 0):
        part = mine[start: start + batch]
        tokens = on_device[part.start: part.stop: part.step]  # [batch, ctx]
        _, cache = model.run_with_cache(tokens, names_filter=names, return_logits=False)
        per_token = _per_token_stats(model, lenses, [cache.stream(s) for s in locations], locations, tokens)
        for name, stats in per_token.items():
            shape = (len(locations), *tokens.shape)  # [layer, batch, pos]
            agree = stats.pop("agree").view(shape)
            # settled at l: agrees at every layer from l to the last (a reverse running AND).
            settled = agree.flip(0).to(torch.int8).cumprod(0).flip(0).bool()
            values = {"kl": stats["kl"].view(shape).mean(-1), "ce": stats["ce"].view(shape)[:, :, :-1].mean(-1),
                      "entropy": stats["entropy"].view(shape).mean(-1), "top1_agree": agree.float().mean(-1),
                      "settled": settled.float().mean(-1)}
            for k, v in values.items():
                parts[name][k].append(v)  # [layer, batch], kept on the device
    ids, table = list(mine), {}
    for name, lens in lenses.items():  # to the host once, after the loop: [layer, window] per metric
        values = {k: torch.cat(v, 1).cpu() if v else torch.empty(len(locations), 0) for k, v in parts[name].items()}
        for l, s in enumerate(locations):
            if not lens.covers(s):  # a stream the lens does not decode has no numbers, not zeros
                for v in values.values():
                    v[l] = float("nan")
        table[name] = {k: v.tolist() for k, v in values.items()}
    rows = [{"lens": name, "layer": layer, "window": ids[b], **{k: table[name][k][layer][b] for k in METRICS}}
            for b0 in range(0, len(ids), batch) for name in lenses for layer in range(len(locations))
            for b in range(b0, min(b0 + batch, len(ids)))]  # one process's order: batch, lens, layer, window
    if world > 1:
        rows = _gathered(rows, list(lenses), batch, world)
    return pd.DataFrame(rows)


def _distributed() -> tuple[int, int]:
    """(rank, world size): (0, 1) unless torch.distributed is initialised (e.g. under torchrun)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _gathered(rows: list[dict], names: list[str], batch: int, world: int) -> list[dict]:
    """Every rank's rows, on every rank, in the order one process makes them (batch, lens, layer, window), so
    that the tables built from them are one process's up to float rounding."""
    every: list[list[dict]] = [[] for _ in range(world)]
    torch.distributed.all_gather_object(every, rows)
    order = {name: i for i, name in enumerate(names)}
    return sorted((r for part in every for r in part),
                  key=lambda r: (r["window"] // batch, order[r["lens"]], r["layer"], r["window"]))


def _per_token_stats(model: HookedTransformer, lenses: dict[str, Lens], hs: list[torch.Tensor], locations,
                     tokens: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """{lens: {kl, ce, entropy: float32, agree: bool}} of shape [layer, batch * pos], a chunk of tokens at a time.

    With z a row of lens logits, peak its largest value and e_v = exp(z_v - peak): lse = peak + log sum e,
    H(q) = log sum e - sum e (z - peak) / sum e, CE = lse - z[next]. With the final's own e^f, peak^f:
    KL(p || q) = sum p log p - sum p log q = (sum e^f (z^f - peak^f) - sum e^f (z - peak)) / sum e^f
    + log sum e - log sum e^f, which is exactly 0 where z = z^f. A lens that reads the last stream as the
    model does (`Lens.reads_as_model`) takes the final's own numbers there instead of computing them again."""
    n_layers, d_model = len(locations), hs[0].shape[-1]
    flat = [h.reshape(-1, d_model) for h in hs]  # [batch * pos, d_model] per stream
    n, d_vocab = len(flat[0]), model.readout.d_vocab
    device = model.readout.weight.device  # where every lens reads out (under a device map, not the streams' device)
    next_ids = torch.cat([tokens[:, 1:], tokens[:, :1]], 1).reshape(-1, 1).to(device)  # pos-1's is a stand-in, dropped later
    chunk = min(n, chunk_rows(model.readout, BUFFERS))
    final_z, final_e, z, scratch = torch.empty(BUFFERS, chunk, d_vocab, dtype=torch.float32, device=device)
    out = {name: {k: torch.empty(n_layers, n, dtype=torch.float32, device=z.device) for k in ("kl", "ce", "entropy")}
           for name in lenses}
    for name in lenses:
        out[name]["agree"] = torch.empty(n_layers, n, dtype=torch.bool, device=z.device)
    last = locations[-1]
    for t0 in range(0, n, chunk):
        t1 = min(t0 + chunk, n)
        rows, c = slice(t0, t1), t1 - t0
        f_e, buf = final_e[:c], scratch[:c]
        f = model.readout.into(flat[-1][rows], final_z[:c])
        top, f_log_mass, f_weighted, f_mass = shifted_stats(f, f_e, buf)  # top: the final's top-1, as argmax; f_e kept
        f_ce, f_entropy = f_log_mass - f.gather(1, next_ids[rows]).squeeze(1), f_log_mass - f_weighted / f_mass
        for name, lens in lenses.items():
            o = out[name]
            for l, s in enumerate(locations):
                if not lens.covers(s):  # NaN, and never agreeing: prediction depth counts the stream as unsettled
                    o["kl"][l, rows], o["ce"][l, rows], o["entropy"][l, rows], o["agree"][l, rows] = torch.nan, torch.nan, torch.nan, False
                    continue
                if s == last and lens.reads_as_model(s):
                    o["kl"][l, rows], o["ce"][l, rows], o["entropy"][l, rows], o["agree"][l, rows] = 0.0, f_ce, f_entropy, True
                    continue
                zl = lens.logits_into(flat[l][rows], s, z[:c])
                top_l, log_mass, weighted, mass = shifted_stats(zl, buf)  # zl shifted in place to z - peak
                o["kl"][l, rows] = (f_weighted - cross_term(f_e, zl, buf)) / f_mass + (log_mass - f_log_mass)
                o["ce"][l, rows] = log_mass - zl.gather(1, next_ids[rows]).squeeze(1)
                o["entropy"][l, rows] = log_mass - weighted / mass
                o["agree"][l, rows] = (top_l == top).squeeze(1)
    return out


def per_layer(tidy: pd.DataFrame, n_tokens: int | None = None, n_bytes: int | None = None) -> pd.DataFrame:
    """Tidy rows -> one row per layer with lenses side by side: `kl_<lens>, ce_<lens>, entropy_<lens>,
    top1_agree_<lens>, settled_<lens>`, plus `<col>_bpb` bits-per-byte twins of the kl/ce/entropy columns
    when `n_tokens` and `n_bytes` (the text the tokens encode) are given."""
    means = tidy.groupby(["lens", "layer"], sort=False)[list(METRICS)].mean()
    wide = means.unstack("lens")
    order = list(dict.fromkeys(tidy["lens"]))
    wide.columns = [f"{metric}_{lens}" for metric, lens in wide.columns]
    cols = [f"{m}_{lens}" for m in METRICS for lens in order]
    table = wide[cols].reset_index().sort_values("layer", ignore_index=True)
    if n_tokens is not None and n_bytes is not None:
        nats = [f"{m}_{lens}" for m in ("kl", "ce", "entropy") for lens in order]
        table = metrics.with_bits_per_byte(table, n_tokens, n_bytes, columns=nats)
    table.attrs["prediction_depth"] = prediction_depth(tidy)
    return table


def prediction_depth(tidy: pd.DataFrame) -> dict[str, float]:
    """Mean prediction depth per lens, in layers: E[depth] = sum over l < n_layers of P(depth > l) = sum (1 - settled_l)."""
    means = tidy.groupby(["lens", "layer"], sort=False)["settled"].mean()
    out = {}
    for lens in dict.fromkeys(tidy["lens"]):
        settled = means[lens].sort_index().fillna(0.0)  # a stream the lens does not cover is not settled
        out[lens] = float((1 - settled.iloc[:-1]).sum())
    return out


def side_by_side(tidy: pd.DataFrame, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Tidy rows of `evaluate_windows` -> one row per (lens, layer): each metric's mean over windows with a 95%
    bootstrap interval over windows (`kl, kl_lo, kl_hi, ce, ...`, the same draws for every lens, so lenses
    are compared on equal terms), and the lens's mean prediction depth with its interval (one value per lens,
    repeated on its rows). A window's prediction depth is sum over l < n_layers of (1 - settled_l).

    >>> table = side_by_side(evaluate_windows(model, {"logit": LogitLens(model), "tuned": tuned}, windows, progress=False))
    >>> table[["lens", "layer", "kl", "kl_lo", "kl_hi"]].head(2).columns.tolist()
    ['lens', 'layer', 'kl', 'kl_lo', 'kl_hi']
    >>> bool((table["kl_lo"] <= table["kl"]).all() and (table["kl"] <= table["kl_hi"]).all())
    True
    """
    table = None
    for metric in METRICS:
        ci = metrics.bootstrap_ci(tidy, metric, by=["lens", "layer"], unit="window", n_boot=n_boot, seed=seed)
        ci = ci.rename(columns={"mean": metric, "lo": f"{metric}_lo", "hi": f"{metric}_hi"}).drop(columns="n")
        table = ci if table is None else table.merge(ci, on=["lens", "layer"])
    last = tidy["layer"].max()
    unsettled = tidy[tidy["layer"] < last].assign(depth=lambda f: 1 - f["settled"].fillna(0.0))
    depth = unsettled.groupby(["lens", "window"], sort=False)["depth"].sum().reset_index()
    depth = metrics.bootstrap_ci(depth, "depth", by="lens", unit="window", n_boot=n_boot, seed=seed).drop(columns="n")
    depth.columns = ["lens", "prediction_depth", "prediction_depth_lo", "prediction_depth_hi"]
    order = {name: i for i, name in enumerate(dict.fromkeys(tidy["lens"]))}
    table = table.merge(depth, on="lens").sort_values(["lens", "layer"], key=lambda c: c.map(order) if c.name == "lens" else c)
    return table.reset_index(drop=True)


def evaluate(model: HookedTransformer, lenses: Mapping[str, Lens] | Sequence[Lens], stream: TokenStream,
             tokens: int | None = None, ctx: int | None = None, batch: int = 8, progress: bool = True) -> pd.DataFrame:
    """The per-layer table for the first `tokens` tokens of `stream` (all of it by default), cut into
    non-overlapping windows of `ctx` (default the model's n_ctx). Bits per byte use the stream's bytes per token.

    `.attrs` holds `prediction_depth` ({lens: mean layers}), `n_tokens` and `n_windows`.
    """
    windows = heldout_windows(stream, tokens, ctx or model.cfg.n_ctx, model.cfg.n_ctx)
    tidy = evaluate_windows(model, lenses, windows, batch=batch, progress=progress)
    table = per_layer(tidy, n_tokens=len(stream), n_bytes=stream.n_bytes)
    table.attrs.update(n_tokens=int(windows.numel()), n_windows=len(windows))
    return table


def heldout_windows(stream: TokenStream, tokens: int | None, ctx: int, n_ctx: int) -> torch.Tensor:
    """The first `tokens` tokens of `stream` (all of it for None) as non-overlapping windows [n_windows, ctx]."""
    if not 2 <= ctx <= n_ctx:
        raise ValueError(f"ctx={ctx} must be between 2 and the model's context n_ctx={n_ctx}; pass a smaller --ctx")
    windows = stream.windows(ctx)
    if tokens is not None:
        if tokens < ctx:
            raise ValueError(f"tokens={tokens} is less than one window of {ctx} tokens; ask for at least {ctx}")
        windows = windows[: tokens // ctx]
    return windows

"""Per-layer evaluation of lenses on held-out text: KL to the final output, cross-entropy, entropy, prediction depth.

Two levels, so that figures can carry confidence bands and tables stay small:

- `evaluate_windows`: tidy rows, one per (lens, layer, window), each the mean over that window's tokens.
  Tokens inside one window are correlated, so windows are the unit of the confidence intervals.
- `per_layer` / `evaluate`: one row per layer, lenses side by side (`kl_logit, kl_tuned, ce_logit, ...`),
  in nats per token with bits-per-byte twins (`*_bpb`).

>>> table = evaluate(model, {"logit": LogitLens(model), "tuned": tuned}, heldout_stream, tokens=2**15)
>>> table[["layer", "kl_logit", "kl_tuned"]]
>>> table.attrs["prediction_depth"]     # {"logit": 3.1, "tuned": 2.2}: mean over tokens, in layers
"""

from __future__ import annotations

from typing import Mapping, Sequence

import pandas as pd
import torch
from tqdm import tqdm  # tqdm.auto warns in kernels without ipywidgets

from lenskit import HookedTransformer
from lenskit.data import TokenStream
from lenskit.linear import linear_into
from lenskit.stream import streams

from . import metrics
from .base import Lens
from .row_stats import row_stats

METRICS = ("kl", "ce", "entropy", "top1_agree", "settled")
# Logits are worked on in chunks of about this many bytes of float32 (two reused buffers), at least CHUNK_ROWS
# rows so that the matmul still runs at speed on a large vocabulary. With torch ops for the row statistics
# and two threads, 8,192 tokens took 1.39 s at 8 MiB, 1.46 at 4, 1.50 at 16 and 1.68 at 32.
CHUNK_BYTES = 8 * 2**20
CHUNK_ROWS = 64


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
    """
    lenses = _named(lenses)
    for name, lens in lenses.items():
        if lens.model is not model:
            raise ValueError(f"lens {name!r} was built for another model object; build it on the model being evaluated")
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [n_windows, ctx] with ctx >= 2, got shape {tuple(windows.shape)}")
    locations = streams(model.cfg.n_layers)  # the streams after 0..n_layers blocks
    names = [s.hook_name(model.cfg.n_layers) for s in locations]
    rows = []
    for start in tqdm(range(0, len(windows), batch), desc="evaluate", disable=not progress):
        tokens = windows[start: start + batch].to(model.embed.weight.device)
        # The final logits are computed below in chunks from the last stream, into reused memory: a whole
        # batch of them is a large fresh allocation on every batch.
        _, cache = model.run_with_cache(tokens, names_filter=names, return_logits=False)
        last = cache.stream(locations[-1])
        # The final distribution once per batch: KL(final || lens) = sum p log p - sum p log q.
        linear = {name: _linear_readout(model, lens) for name, lens in lenses.items()}
        # Any other lens compares its full log-softmax with the final one, and a half-precision readout rounds
        # differently in chunks of another shape: then the whole batch's logits, once, as the forward makes them.
        whole = model.readout(last) if not all(linear.values()) or last.dtype != torch.float32 else None
        target = _final_stats(model, last, tokens, whole)
        final_top = target["top"].view(tokens.shape)  # [batch, pos]
        final_neg_entropy = target["neg_entropy"].view(tokens.shape)
        next_tokens = tokens[:, 1:, None]
        final_p = None  # [batch, pos, d_vocab], only for lenses that need the full log-softmax
        for name, lens in lenses.items():
            if linear[name]:
                stats, agree = _linear_stats(model, lens, cache, locations, tokens, target)
            if not linear[name] or not all(torch.isfinite(v).all() for v in stats.values()):
                # any other lens, and infinities (zero-mass tokens), through the full log-softmax and 0 log 0 = 0
                if final_p is None:
                    final_p = metrics.log_probs(model.readout(last) if whole is None else whole).exp()
                stats, agree = _plain_stats(lens, cache, locations, next_tokens, final_neg_entropy, final_p, final_top)
            # settled at l: agrees at every layer from l to the last (a reverse running AND).
            settled = agree.flip(0).to(torch.int8).cumprod(0).flip(0).bool()
            stats["top1_agree"] = agree.float().mean(-1)
            stats["settled"] = settled.float().mean(-1)
            values = {k: stats[k].tolist() for k in METRICS}  # [layer][window] floats
            for layer in range(len(names)):
                for b in range(tokens.shape[0]):
                    rows.append({"lens": name, "layer": layer, "window": start + b, **{k: values[k][layer][b] for k in METRICS}})
    return pd.DataFrame(rows)


def _plain_stats(lens: Lens, cache, locations, next_tokens: torch.Tensor, final_neg_entropy: torch.Tensor,
                 final_p: torch.Tensor, final_top: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Any lens, from its full log-softmax at every layer: ({kl, ce, entropy: [layer, batch]}, agree [layer, batch, pos])."""
    stats = {k: [] for k in ("kl", "ce", "entropy")}
    agree = []
    for s in locations:
        logq = metrics.log_probs(lens(cache.stream(s), s))  # [batch, pos, d_vocab], one softmax per layer
        stats["kl"].append((final_neg_entropy - _expect(final_p, logq)).mean(-1))
        stats["ce"].append(-logq[:, :-1].gather(-1, next_tokens).squeeze(-1).mean(-1))
        stats["entropy"].append(-_expect(logq.exp(), logq).mean(-1))
        agree.append(logq.argmax(-1) == final_top)
    return {k: torch.stack(v) for k, v in stats.items()}, torch.stack(agree)


def _linear_readout(model: HookedTransformer, lens: Lens) -> bool:
    """Whether the lens's logits are `unembed(ln_final(transform_hidden(h)))` with no soft-cap after them: a
    readout linear after the norm, which `_linear_stats` may evaluate without a full log-softmax. Float32 models
    only: in bfloat16 the same logits computed in chunks of other shapes round differently, which turns near-ties
    of the top-1 (even at the last layer) the other way, so half-precision models keep the plain path."""
    return (model.cfg.final_softcap is None and type(model).readout is HookedTransformer.readout
            and model.unembed.weight.dtype == torch.float32
            and type(lens).forward is Lens.forward and type(lens).unembed is Lens.unembed
            and isinstance(model.unembed, torch.nn.Linear))


def _next_ids(tokens: torch.Tensor) -> torch.Tensor:
    """tokens [batch, pos] -> the next token at every position [batch * pos]; position pos - 1 has none, so it
    gets a stand-in (the window's first token) that every cross-entropy drops."""
    return torch.cat([tokens[:, 1:], tokens[:, :1]], 1).reshape(-1)


def _chunk_rows(rows: int, d_vocab: int) -> int:
    """Rows of logits per chunk: about CHUNK_BYTES of float32, at least CHUNK_ROWS, at most `rows`."""
    return min(rows, max(CHUNK_ROWS, CHUNK_BYTES // (4 * d_vocab)))


def _final_stats(model: HookedTransformer, last: torch.Tensor, tokens: torch.Tensor,
                 whole: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """`metrics.target_sums` of the model's own logits for every token of the batch, plus z_next (the next
    token's logit; the last position's is a stand-in). The logits are `whole` [batch, pos, d_vocab] when given,
    else computed from the last stream [batch, pos, d_model] a chunk of tokens at a time into one reused buffer
    (a linear float32 readout, `_linear_readout`): a whole batch of them is a large fresh allocation."""
    weight, bias = model.unembed.weight, model.unembed.bias
    h = last.reshape(-1, last.shape[-1])
    n, d_vocab = len(h), weight.shape[0]
    next_ids = _next_ids(tokens)
    chunk = _chunk_rows(n, d_vocab)
    buffers = torch.empty(3, chunk, d_vocab, dtype=torch.float32, device=h.device)  # logits, then scratch
    if whole is None:
        normed = model.ln_final(h)
    parts = []
    for t0 in range(0, n, chunk):
        t1 = min(t0 + chunk, n)
        f = whole.view(n, -1)[t0:t1] if whole is not None else linear_into(normed[t0:t1], weight, bias, buffers[0, : t1 - t0])
        sums = metrics.target_sums(f, weight, bias, scratch=buffers[1:])
        sums["z_next"] = f.gather(1, next_ids[t0:t1, None]).squeeze(1).float()
        parts.append(sums)
    return {k: torch.cat([part[k] for part in parts]) for k in parts[0]}


def _linear_stats(model: HookedTransformer, lens: Lens, cache, locations, tokens: torch.Tensor,
                  target: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`_plain_stats` for a linear readout, every layer of the lens in a few large matmuls and few passes over
    the logits (float32 throughout). With z the logits of one (layer, token) row and lse = log sum_v exp z_v:
    KL(p || q) = sum p log p - (sum p z - lse sum p), where sum p z = x . (p W_U) + p . b needs no logits;
    CE = lse - z[next]; H(q) = lse - sum q z; top-1 agreement from z at the final's top-1 against max z."""
    batch, pos = tokens.shape
    n_layers, n = len(locations), batch * pos
    x = torch.stack([model.ln_final(lens.transform_hidden(cache.stream(s), lens.stream(s)).float()).reshape(n, -1)
                     for s in locations])  # [layer, batch * pos, d_model]
    p_w, p_b, p_mass, final_neg_entropy = target["p_w"], target["p_b"], target["mass"], target["neg_entropy"]
    # A lens that leaves the last stream as it is reads there the model's own output: its rows come from it.
    reads_final = torch.equal(x[-1], model.ln_final(cache.stream(locations[-1]).float()).reshape(n, -1))
    rows_total, d_vocab = (n_layers - reads_final) * n, model.unembed.weight.shape[0]  # float32 (`_linear_readout`)
    flat = x.reshape(n_layers * n, -1)
    next_ids = _next_ids(tokens).repeat(n_layers)  # the next token of each row; stand-ins dropped below
    chunk = _chunk_rows(rows_total, d_vocab)
    z = torch.empty(chunk, d_vocab, dtype=torch.float32, device=x.device)  # reused for every chunk
    scratch = torch.empty_like(z)
    # Per row: the logit at the final's top-1 token, the largest other logit, the next token's logit,
    # S = sum_v exp(z_v - peak) >= 1, sum_v exp(z_v - peak) (z_v - peak), and whether the lens's top-1 (the
    # first maximum, as argmax) is the final's.
    at_top, runner_up, z_next, mass, weighted = (torch.empty(n_layers * n, dtype=torch.float32, device=x.device)
                                                 for _ in range(5))
    agree = torch.empty(n_layers * n, dtype=torch.bool, device=x.device)
    final_ids = target["top"].repeat(n_layers)
    for r0 in range(0, rows_total, chunk):
        r1 = min(r0 + chunk, rows_total)
        out = z[: r1 - r0]
        linear_into(flat[r0:r1], model.unembed.weight, model.unembed.bias, out)
        torch.gather(out, 1, next_ids[r0:r1, None], out=z_next[r0:r1, None])
        row_stats(out, final_ids[r0:r1], at_top[r0:r1], runner_up[r0:r1], mass[r0:r1], weighted[r0:r1],
                  agree[r0:r1], scratch)
    peak = torch.maximum(runner_up, at_top)
    log_mass = mass.log()
    lse = peak + log_mass
    entropy = log_mass - weighted / mass  # H = lse - sum q z = log S - sum q (z - peak)
    if reads_final:
        lse[rows_total:] = target["lse"]
        z_next[rows_total:] = target["z_next"]
        entropy[rows_total:] = -final_neg_entropy.reshape(n)
        agree[rows_total:] = True
    p_z = torch.einsum("lnd,nd->ln", x, p_w) + p_b  # [layer, batch * pos]
    kl = final_neg_entropy.reshape(1, n) - (p_z - lse.view(n_layers, n) * p_mass)
    ce = (lse - z_next).view(n_layers, batch, pos)[:, :, :-1]
    stats = {"kl": kl.view(n_layers, batch, pos).mean(-1), "ce": ce.mean(-1),
             "entropy": entropy.view(n_layers, batch, pos).mean(-1)}
    agree = agree.view(n_layers, batch, pos)
    return stats, agree


def _expect(p: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """sum_v p(v) f(v) over the last axis (a row-wise dot product: 4x faster than the same as a batched matmul).
    Where that is not finite, e.g. a token of zero mass meeting log 0 = -inf, it is summed again with
    `metrics`' convention 0 * f = 0 (NaN probabilities stay NaN)."""
    out = torch.linalg.vecdot(p, f)
    if not torch.isfinite(out).all():
        out = torch.where(p == 0, torch.zeros((), dtype=f.dtype, device=f.device), p * f).sum(-1)
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
        settled = means[lens].sort_index()
        out[lens] = float((1 - settled.iloc[:-1]).sum())
    return out


def evaluate(model: HookedTransformer, lenses: Mapping[str, Lens] | Sequence[Lens], stream: TokenStream,
             tokens: int | None = None, ctx: int | None = None, batch: int = 8, progress: bool = True) -> pd.DataFrame:
    """The per-layer table for the first `tokens` tokens of `stream` (all of it by default), cut into
    non-overlapping windows of `ctx` (default the model's n_ctx). Bits per byte use the stream's bytes per token.

    `.attrs` holds `prediction_depth` ({lens: mean layers}), `n_tokens` and `n_windows`.
    """
    ctx = ctx or model.cfg.n_ctx
    if not 2 <= ctx <= model.cfg.n_ctx:
        raise ValueError(f"ctx={ctx} must be between 2 and the model's context n_ctx={model.cfg.n_ctx}; pass a smaller --ctx")
    windows = stream.windows(ctx)
    if tokens is not None:
        if tokens < ctx:
            raise ValueError(f"tokens={tokens} is less than one window of {ctx} tokens; ask for at least {ctx}")
        windows = windows[: tokens // ctx]
    tidy = evaluate_windows(model, lenses, windows, batch=batch, progress=progress)
    table = per_layer(tidy, n_tokens=len(stream), n_bytes=stream.n_bytes)
    table.attrs.update(n_tokens=int(windows.numel()), n_windows=len(windows))
    return table

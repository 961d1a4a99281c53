"""Distances between next-token distributions, all from logits, all in nats unless a name says bits.

Every function takes logits `[..., d_vocab]` and reduces the last axis, so it works on one position,
a [batch, pos] grid or a [layer, batch, pos] stack alike. Probabilities are never exponentiated and
then logged again: everything goes through `log_softmax`, in at least float32, so a peaked
distribution (p = 1 - 1e-9) still gives a finite, exact answer.

Direction matters for KL. `kl_divergence(p, q)` is KL(p || q) = sum_v p(v) (log p(v) - log q(v)):
the extra nats paid for coding samples from p with a code built for q. For a lens, the
tuned-lens paper's convention is KL(final || lens) (`forward_kl`): how badly the lens's guess
covers what the model finally predicts.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

LN2 = math.log(2.0)


def first_max(f: torch.Tensor, block: int = 64) -> torch.Tensor:
    """The index of each row's first maximum, as `argmax` (NaN counts as the maximum), in about a fifth of
    its time on the CPU: the largest value of every block of `block` columns (amax, a fast reduction), the
    first block holding the row's maximum, then the first maximum inside that block."""
    rows, cols = f.shape
    if cols < 4 * block:
        return f.max(-1).indices
    whole = cols // block * block
    blocks = f[:, :whole].view(rows, -1, block).amax(-1)  # [rows, cols // block]
    if whole < cols:
        blocks = torch.cat([blocks, f[:, whole:].amax(-1, keepdim=True)], 1)
    b = blocks.max(-1).indices  # the first block that holds the maximum
    start = (b * block)[:, None] + torch.arange(block, device=f.device)
    inside = f.gather(1, start.clamp_(max=cols - 1))  # the last block may be short: its clamped columns repeat
    return b * block + inside.max(-1).indices


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """[..., d_vocab] logits -> log-probabilities, upcast to float32 when the input is half precision."""
    if not logits.dtype.is_floating_point:
        raise TypeError(f"expected floating-point logits, got dtype {logits.dtype}")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.log_softmax(logits, dim=-1)


def _pair(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if p_logits.shape[-1] != q_logits.shape[-1]:
        raise ValueError(f"the two distributions have different vocabularies: {p_logits.shape[-1]} vs {q_logits.shape[-1]}")
    return log_probs(p_logits), log_probs(q_logits)


def _expect(logp: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """sum_v p(v) f(v) with the convention 0 * f = 0, so a token of zero mass never gives 0 * inf = nan.
    NaN probabilities stay NaN: a broken distribution must not come out as a finite number."""
    p = logp.exp()
    return torch.where(p == 0, torch.zeros((), dtype=f.dtype, device=f.device), p * f).sum(-1)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(p) = -sum_v p(v) log p(v), nats: [..., d_vocab] -> [...]."""
    logp = log_probs(logits)
    return -_expect(logp, logp)


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p(v) (log p(v) - log q(v)), nats: [..., d_vocab] x2 -> [...]. Not symmetric."""
    logp, logq = _pair(p_logits, q_logits)
    return _expect(logp, logp - logq)


def forward_kl(final_logits: torch.Tensor, lens_logits: torch.Tensor) -> torch.Tensor:
    """KL(final || lens), nats: the tuned-lens paper's lens loss and `Trajectory.kl_to_final`."""
    return kl_divergence(final_logits, lens_logits)


def reverse_kl(final_logits: torch.Tensor, lens_logits: torch.Tensor) -> torch.Tensor:
    """KL(lens || final), nats: mode-seeking, large where the lens is confident and the model is not."""
    return kl_divergence(lens_logits, final_logits)


def soft_cross_entropy(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """H(p, q) = -sum_v p(v) log q(v) = H(p) + KL(p || q), nats: [..., d_vocab] x2 -> [...]."""
    logp, logq = _pair(p_logits, q_logits)
    return -_expect(logp, logq)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log q(target), nats per token: logits [..., d_vocab], integer targets [...] -> [...]."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets must have the logits' leading shape {tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point:
        raise TypeError(f"targets must be integer token ids, got dtype {targets.dtype}")
    return -log_probs(logits).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def js_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence 0.5 KL(p || m) + 0.5 KL(q || m), m = (p + q) / 2, nats, in [0, log 2].

    Symmetric, and finite even where one distribution puts zero mass. (This is the real JSD, not
    half the sum of the two KLs between p and q.)
    """
    logp, logq = _pair(p_logits, q_logits)
    logm = torch.logaddexp(logp, logq) - LN2
    kl_pm = _expect(logp, logp - logm)
    kl_qm = _expect(logq, logq - logm)
    return 0.5 * kl_pm + 0.5 * kl_qm


def total_variation(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Total variation distance 0.5 * sum_v |p(v) - q(v)|, in [0, 1] (half the L1 distance)."""
    logp, logq = _pair(p_logits, q_logits)
    return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)


def target_rank(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Rank of each target token, 0 = the top-1 prediction: logits [..., d_vocab], targets [...] -> [...].

    Ties count in the target's favour: rank = number of tokens with a strictly larger logit.
    """
    picked = logits.gather(-1, targets.long().unsqueeze(-1))  # [..., 1]
    return (logits > picked).sum(-1)


# ----------------------------------------------------------------- units
def nats_to_bits(nats: float | torch.Tensor) -> float | torch.Tensor:
    return nats / LN2


def bits_per_byte(nats_per_token: float | torch.Tensor, n_tokens: int, n_bytes: int) -> float | torch.Tensor:
    """Mean nats per token -> bits per UTF-8 byte of the text those tokens encode.

    Comparable across tokenizers, unlike nats per token: total bits = nats_per_token * n_tokens / ln 2,
    shared over the n_bytes of the text.

    >>> round(bits_per_byte(1.0, n_tokens=100, n_bytes=400), 6)   # 100 nats over 400 bytes: 100 / 400 / ln 2
    0.360674
    """
    if n_tokens <= 0 or n_bytes <= 0:
        raise ValueError(f"n_tokens and n_bytes must be positive, got n_tokens={n_tokens}, n_bytes={n_bytes}")
    return nats_per_token * n_tokens / (n_bytes * LN2)


def with_bits_per_byte(frame: pd.DataFrame, n_tokens: int, n_bytes: int, columns: list[str] | None = None) -> pd.DataFrame:
    """A copy of `frame` with a `<col>_bpb` column next to each nats-per-token column named in `columns`."""
    out = frame.copy()
    for col in columns if columns is not None else [c for c in frame.columns if c.startswith(("kl", "ce"))]:
        out.insert(out.columns.get_loc(col) + 1, f"{col}_bpb", bits_per_byte(frame[col], n_tokens, n_bytes))
    return out


# ------------------------------------------------------ summaries for plots
# Two-sided 97.5% quantiles of Student's t for 1..30 degrees of freedom; beyond 30 the normal's 1.96
# is within 2%. Written out so the library needs no scipy.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(dof: int) -> float:
    if dof < 1:
        return float("nan")
    return _T975[dof - 1] if dof <= len(_T975) else 1.96


def mean_ci(frame: pd.DataFrame, value: str, by: str | list[str] = "layer", unit: str | None = None) -> pd.DataFrame:
    """Mean of `value` per group with a 95% confidence interval (Student's t): columns by..., mean, lo, hi, n.

    Rows within one `unit` (e.g. the positions of one prompt) are correlated, so when `unit` is given
    they are averaged first and the interval is taken across units; n then counts units.

    >>> df = pd.DataFrame({"lens": "logit", "layer": 3, "prompt": [0, 0, 1, 1], "kl_to_final": [1.0, 3.0, 2.0, 4.0]})
    >>> mean_ci(df, "kl_to_final", by=["lens", "layer"], unit="prompt")[["lens", "layer", "mean", "n"]]
        lens  layer  mean  n
    0  logit      3   2.5  2
    """
    by = [by] if isinstance(by, str) else list(by)
    missing = [c for c in [value, *by, *([unit] if unit else [])] if c not in frame.columns]
    if missing:
        raise KeyError(f"mean_ci needs columns {missing}; the frame has {list(frame.columns)}")
    if unit is not None:
        frame = frame.groupby([*by, unit], sort=True)[value].mean().reset_index()
    g = frame.groupby(by, sort=True)[value]
    out = g.agg(mean="mean", sd="std", n="count").reset_index()
    half = [t_quantile_975(int(n) - 1) * sd / math.sqrt(n) if n > 1 else float("nan") for n, sd in zip(out["n"], out["sd"])]
    out["lo"] = out["mean"] - half
    out["hi"] = out["mean"] + half
    return out[[*by, "mean", "lo", "hi", "n"]]


def bootstrap_ci(frame: pd.DataFrame, value: str, by: str | list[str] = "layer", unit: str = "window",
                 n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Mean of `value` per group with a 95% percentile-bootstrap interval over `unit`s: columns by..., mean, lo,
    hi, n. Rows are first averaged within each unit (a window's tokens are correlated); the units are then
    resampled with replacement, the same draw for every group, so groups measured on the same units (two
    models on the same windows) are compared fairly. Deterministic for a `seed`.

    >>> tidy = pd.DataFrame({"lens": "logit", "layer": 3, "window": range(8), "kl": [1.0, 2.0] * 4})
    >>> bootstrap_ci(tidy, "kl", by=["lens", "layer"], unit="window")[["lens", "layer", "mean"]]
        lens  layer  mean
    0  logit      3   1.5
    """
    by = [by] if isinstance(by, str) else list(by)
    missing = [c for c in [value, *by, unit] if c not in frame.columns]
    if missing:
        raise KeyError(f"bootstrap_ci needs columns {missing}; the frame has {list(frame.columns)}")
    wide = frame.groupby([*by, unit], sort=True)[value].mean().unstack(unit)  # [group, unit]
    values = torch.tensor(wide.to_numpy(), dtype=torch.float64)
    n = values.shape[1]
    draws = _unit_draws(n, n_boot, seed)
    boots = values[:, draws].nanmean(-1)  # [group, n_boot]
    out = wide.index.to_frame(index=False)
    out["mean"] = values.nanmean(-1).numpy()
    out["lo"] = boots.quantile(0.025, dim=-1).numpy()
    out["hi"] = boots.quantile(0.975, dim=-1).numpy()
    out["n"] = (~values.isnan()).sum(-1).numpy()
    return out


def _unit_draws(n_units: int, n_boot: int, seed: int) -> torch.Tensor:
    """[n_boot, n_units] unit indices drawn with replacement: the draws every bootstrap here shares for a seed."""
    return torch.randint(0, n_units, (n_boot, n_units), generator=torch.Generator().manual_seed(seed))


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n along the last axis, ties sharing their average rank (as Spearman's rho wants): [..., n] -> [..., n]."""
    below = (x[..., None, :] < x[..., :, None]).sum(-1)  # [..., n]: how many values are smaller
    equal = (x[..., None, :] == x[..., :, None]).sum(-1)  # itself included
    return below.double() + (equal.double() + 1) / 2


def spearman(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Spearman's rank correlation of x and y along the last axis: [..., n] x2 -> [...], in [-1, 1]; NaN where
    either is constant. The Pearson correlation of the (average) ranks; no scipy needed."""
    if x.shape != y.shape or x.shape[-1] < 2:
        raise ValueError(f"spearman needs two equal shapes with at least 2 values in the last axis, got "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(-1, keepdim=True), ry - ry.mean(-1, keepdim=True)
    return (rx * ry).sum(-1) / (rx.square().sum(-1) * ry.square().sum(-1)).sqrt()


def bootstrap_spearman(frame: pd.DataFrame, x: str, y: str, over: str, unit: str = "window", n_boot: int = 2000,
                       seed: int = 0) -> dict[str, float]:
    """Spearman's rho between the means of `x` and of `y` per `over` group (e.g. per direction), with a 95%
    percentile-bootstrap interval over `unit`s: each draw resamples the units with replacement (the draws of
    `bootstrap_ci` for the same seed) and correlates the groups' means over the drawn units.
    Returns {"rho", "lo", "hi", "n_groups", "n_units"}.

    >>> tidy = pd.DataFrame({"direction": [0, 1, 2] * 4, "window": [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3],
    ...                      "lens_influence": [3.0, 2.0, 1.0] * 4, "model_influence": [0.3, 0.2, 0.1] * 4})
    >>> bootstrap_spearman(tidy, "lens_influence", "model_influence", over="direction", unit="window")["rho"]
    1.0
    """
    missing = [c for c in (x, y, over, unit) if c not in frame.columns]
    if missing:
        raise KeyError(f"bootstrap_spearman needs columns {missing}; the frame has {list(frame.columns)}")
    wide = {c: torch.tensor(frame.groupby([over, unit], sort=True)[c].mean().unstack(unit).to_numpy(),
                            dtype=torch.float64) for c in (x, y)}  # [group, unit] each
    n_groups, n_units = wide[x].shape
    draws = _unit_draws(n_units, n_boot, seed)
    boots = spearman(wide[x][:, draws].nanmean(-1).T, wide[y][:, draws].nanmean(-1).T)  # [n_boot]
    rho = spearman(wide[x].nanmean(-1), wide[y].nanmean(-1))
    lo, hi = boots.nanquantile(torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"rho": float(rho), "lo": lo, "hi": hi, "n_groups": int(n_groups), "n_units": int(n_units)}

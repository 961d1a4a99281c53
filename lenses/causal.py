"""Causal basis extraction and causal fidelity (Belrose et al. 2023): do the directions a lens relies on at a
stream matter to the model too?

Mean ablation. For an orthonormal V [d_model, k] and the stream's mean mu over the data,

    r(h) = h - (h - mu) V V^T

sets h's coordinates along V to their mean and leaves the rest of h as it was.

Causal basis extraction (CBE). The lens's influence of a unit direction v at stream s is

    E_t[ KL(lens(h_t, s) || lens(r_v(h_t), s)) ]        (over the tokens t of the data, nats)

and the causal basis is found one direction at a time: v_1 maximises it over unit vectors, v_j maximises
it over unit vectors orthogonal to v_1 .. v_{j-1}. Each direction is ablated alone when it is scored.

Causal fidelity. The model's influence of v_j is E_t[KL(model(x)_t || model'(x)_t)], with model' the model
with v_j mean-ablated in its own stream s (every later block reads the ablated stream): `ablate_subspace`.
A lens that uses the model's features has directions that matter to it matter to the model, and the paper
reports the Spearman correlation of the two influences across directions.

>>> basis = extract_causal_bases(tuned, stream_hiddens(model, windows, 3), k=8, stream=3)
>>> with ablate_subspace(model, 3, basis.vectors[:, :1], mean=basis.mean):
...     logits = model(tokens)
>>> table = causal_fidelity(model, tuned, windows, stream=3, k=8)    # per direction; .attrs["spearman"]
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import pandas as pd
import torch
from tqdm import tqdm  # tqdm.auto warns in kernels without ipywidgets

from lenskit import HookedTransformer, Stream
from lenskit.observe.stream import as_stream

from . import metrics
from .base import BasisLens, Lens
from .chunks import chunk_rows
from .training.step import readout_kl_and_grad

# Lens logits are worked a chunk of tokens at a time, as many rows as `lenses.chunks.chunk_rows` gives the device for
# this many [rows, d_vocab] float32 tensors (autograd keeps a few), so memory stays bounded whatever the number of tokens.
BUFFERS = 4


@dataclass(frozen=True)
class CausalBasis:
    """Directions found by `extract_causal_bases` at `stream`, in the order found.

    vectors [d_model, k], orthonormal columns; energies [k], each direction's lens influence (nats, its
    objective at the optimum); mean [d_model], the stream mean the ablations use.
    """

    stream: Stream
    vectors: torch.Tensor
    energies: torch.Tensor
    mean: torch.Tensor


def mean_ablate(h: torch.Tensor, vectors: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """h [..., d_model] with its coordinates along the orthonormal columns of vectors [d_model, k] (or one
    vector [d_model]) set to those of `mean` [d_model]: h - (h - mean) V V^T. mean None projects them out."""
    v = vectors.to(h.dtype)[:, None] if vectors.ndim == 1 else vectors.to(h.dtype)
    centred = h if mean is None else h - mean.to(h.dtype)
    return h - (centred @ v) @ v.T  # [..., k] coordinates, back to [..., d_model]


def ablation_hook(model: HookedTransformer, stream: int | str | Stream, vectors: torch.Tensor,
                  mean: torch.Tensor | None = None) -> tuple[str, Callable]:
    """(hook name, fn) that mean-ablates `vectors` from `stream` in the model's forward, for `run_with_hooks`."""
    s = as_stream(stream).resolve(model.cfg.n_layers)

    def ablate(x: torch.Tensor, hook) -> torch.Tensor:
        return mean_ablate(x, vectors.to(x.device), None if mean is None else mean.to(x.device))

    return s.hook_name(model.cfg.n_layers), ablate


@contextmanager
def ablate_subspace(model: HookedTransformer, stream: int | str | Stream, vectors: torch.Tensor,
                    mean: torch.Tensor | None = None) -> Iterator[HookedTransformer]:
    """Within the block, every forward of `model` reads `stream` with `vectors` mean-ablated (`mean_ablate`).
    The hook belongs to this thread and is removed on exit, also when the block raises; `run_with_hooks`,
    `run_with_cache` and other `model.hooks` inside it add theirs after it (they see the ablated stream)."""
    with model.hooks([ablation_hook(model, stream, vectors, mean)]):
        yield model


@torch.no_grad()
def stream_hiddens(model: HookedTransformer, windows: torch.Tensor, stream: int | str | Stream,
                   batch: int = 8) -> torch.Tensor:
    """The residual stream at `stream` for windows [n_windows, ctx]: [n_windows, ctx, d_model]."""
    s = as_stream(stream).resolve(model.cfg.n_layers)
    name = s.hook_name(model.cfg.n_layers)
    parts = []
    for start in range(0, len(windows), batch):
        tokens = windows[start: start + batch].to(model.embed.weight.device)
        _, cache = model.run_with_cache(tokens, names_filter=[name], return_logits=False)
        parts.append(cache.stream(s))
    return torch.cat(parts)


def _chunk_rows(lens: Lens) -> int:
    return chunk_rows(lens.model.readout, BUFFERS)


@torch.no_grad()
def _influence_rows(lens: Lens, s: Stream, rows: torch.Tensor, vectors: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """KL(lens(h) || lens(r_v(h))) per row of rows [n, d_model] for each column v of vectors [d_model, k]:
    [k, n], nats. The clean logits are computed once for all k."""
    clean = lens(rows, s)  # [n, d_vocab]
    return torch.stack([metrics.forward_kl(clean, lens(mean_ablate(rows, v, mean), s)) for v in vectors.T])


def _influence_and_grad(lens: BasisLens, s: Stream, rows: torch.Tensor, v: torch.Tensor,
                        mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed KL(lens(h) || lens(r_v(h))) over rows [n, d_model], and its gradient with respect to v [d_model].

    The d_vocab-sized part is the tuned-lens training step's (`readout_kl_and_grad`: the KL's gradient with
    respect to the logits written down as q - p, taken through the unembedding in one matmul); autograd
    takes it the rest of the way, through the final norm, the lens's `transform_hidden` and the ablation.
    """
    readout = lens.model.readout
    with torch.no_grad():
        clean = lens(rows, s)  # [n, d_vocab], the target
    leaf = v.detach().requires_grad_(True)
    normed = readout.normed(lens.transform_hidden(mean_ablate(rows, leaf, mean), s))  # [n, d_model]
    kl, grad = readout_kl_and_grad(normed.detach()[None], clean, readout)  # [1], [1, n, d_model]
    (dv,) = torch.autograd.grad(normed, leaf, grad[0])  # for v alone: nothing accumulates in any weight
    return kl[0], dv  # a tensor: the caller sums chunks on the device


def lens_influence(lens: Lens, hiddens: torch.Tensor, stream: int | str | Stream, vectors: torch.Tensor,
                   mean: torch.Tensor | None = None) -> torch.Tensor:
    """Each direction's lens influence, ablated alone: vectors [d_model, k] -> [k, ...] with hiddens' leading
    shape [...] (KL per token, nats); `.mean(-1)` of a [k, tokens] result is the CBE objective. mean: default
    the mean of `hiddens` over every token."""
    s = lens.stream(stream)
    flat = hiddens.detach().reshape(-1, hiddens.shape[-1]).float()
    mean = flat.mean(0) if mean is None else mean.float()
    vectors = (vectors[:, None] if vectors.ndim == 1 else vectors).float()
    chunk = _chunk_rows(lens)
    out = torch.cat([_influence_rows(lens, s, flat[t: t + chunk], vectors, mean) for t in range(0, len(flat), chunk)], 1)
    return out.view(vectors.shape[1], *hiddens.shape[:-1])


def default_init(lens: Lens, s: Stream, k: int) -> torch.Tensor:
    """[d_model, k]: the directions of the stream that move the lens's logits most, to first order and before
    the final norm: the top right singular vectors of W_U M, with M the linear part of the lens's
    `transform_hidden` (the identity for the logit lens; I + A_s for a tuned lens). Deterministic."""
    model = lens.model
    d = model.cfg.d_model
    w_u = model.readout.weight.detach().float()  # [d_vocab, d_model]
    if isinstance(lens, BasisLens):
        with torch.no_grad():
            eye = torch.eye(d, device=w_u.device, dtype=torch.float32)
            rows = lens.transform_hidden(eye, s) - lens.transform_hidden(torch.zeros(1, d, device=w_u.device), s)
        w_u = w_u @ rows.float().T  # row i of `rows` is M e_i, so rows.T = M: W_U M [d_vocab, d_model]
    return torch.linalg.svd(w_u.T, full_matrices=False)[0][:, :k]  # left singular vectors of (W_U M)^T


def extract_causal_bases(lens: Lens, hiddens: torch.Tensor, k: int, *, stream: int | str | Stream,
                         init: torch.Tensor | None = None, mean: torch.Tensor | None = None, max_iter: int = 50,
                         tol: float = 1e-4, progress: bool = False) -> CausalBasis:
    """The first k directions of the causal basis of `lens` at `stream` (see the module docstring), from its
    activations there, hiddens [..., d_model] (e.g. `stream_hiddens`).

    Direction j starts from column j of `init` [d_model, >= k] (default `default_init`), made orthogonal to
    the directions found before it, and climbs the lens influence by L-BFGS (strong Wolfe line search) over
    v = P u / |P u|, P the projection off the earlier directions, for at most `max_iter` iterations or until
    an iteration changes the objective by less than `tol` times its starting value. mean: the stream mean the
    ablation uses (default: hiddens' own). The lens is a `BasisLens` (logit, tuned, Jacobian); it is not changed.
    """
    if not isinstance(lens, BasisLens):
        raise ValueError(f"causal basis extraction differentiates a lens's transform_hidden, and {type(lens).__name__} "
                         "has none; use a LogitLens, TunedLens or JacobianLens")
    s = lens.stream(stream)
    flat = hiddens.detach().reshape(-1, hiddens.shape[-1]).float()
    d = flat.shape[1]
    if not (isinstance(k, int) and 1 <= k <= d):
        raise ValueError(f"k={k!r}: expected a whole number of directions from 1 to d_model={d}")
    if len(flat) < 2:
        raise ValueError(f"hiddens hold {len(flat)} token(s); a stream's mean and its influence need at least 2")
    mean = flat.mean(0) if mean is None else mean.detach().float().to(flat.device)
    start = (default_init(lens, s, k) if init is None else init.detach()).float().to(flat.device)
    if start.shape[0] != d or start.shape[1] < k:
        raise ValueError(f"init has shape {tuple(start.shape)}; expected [d_model={d}, at least k={k}] columns")
    chunk = _chunk_rows(lens)
    found = torch.zeros(d, 0, device=flat.device)
    energies = []
    for _ in tqdm(range(k), desc=f"causal basis at stream {s.layer}", disable=not progress):
        v, energy = _best_direction(lens, s, flat, mean, found, start[:, found.shape[1]], chunk, max_iter, tol)
        found = torch.cat([found, v[:, None]], 1)
        energies.append(energy)
    return CausalBasis(s, found, torch.tensor(energies), mean)


def _best_direction(lens: Lens, s: Stream, flat: torch.Tensor, mean: torch.Tensor, found: torch.Tensor,
                    start: torch.Tensor, chunk: int, max_iter: int, tol: float) -> tuple[torch.Tensor, float]:
    """The unit direction orthogonal to `found` [d_model, j] that L-BFGS reaches from `start`, and its influence."""

    def direction(u: torch.Tensor) -> torch.Tensor:
        u = u - found @ (found.T @ u)  # orthogonal to the directions found so far
        return u / u.norm().clamp_min(torch.finfo(u.dtype).tiny)

    def objective(v: torch.Tensor) -> tuple[float, torch.Tensor]:
        """The mean influence of v over all tokens and its gradient with respect to v, a chunk at a time."""
        total, grad = torch.zeros((), device=v.device), torch.zeros_like(v)
        for t in range(0, len(flat), chunk):
            part, g = _influence_and_grad(lens, s, flat[t: t + chunk], v, mean)
            total, grad = total + part, grad + g
        return float(total) / len(flat), grad / len(flat)  # one read-back per evaluation of the objective

    u = torch.nn.Parameter(direction(start.clone()))
    scale = objective(direction(u.detach()))[0]
    scale = scale if scale > 0 else 1.0  # the loss is -influence / its starting value, so `tol` is relative

    def closure() -> torch.Tensor:
        opt.zero_grad()
        v = direction(u)
        value, grad = objective(v.detach())
        v.backward(-grad / scale)  # through the normalisation and the projection, into u
        return torch.tensor(-value / scale)

    opt = torch.optim.LBFGS([u], lr=1.0, max_iter=max_iter, tolerance_change=tol, tolerance_grad=1e-9,
                            history_size=20, line_search_fn="strong_wolfe")
    opt.step(closure)
    v = direction(u.detach())
    energy = float(torch.cat([_influence_rows(lens, s, flat[t: t + chunk], v[:, None], mean)
                              for t in range(0, len(flat), chunk)], 1).mean())
    return v, energy


@torch.no_grad()
def influence_windows(model: HookedTransformer, lens: Lens, windows: torch.Tensor, basis: CausalBasis,
                      batch: int = 8, progress: bool = False) -> pd.DataFrame:
    """For each direction of `basis`, ablated alone at its stream with its mean, and each window [n_windows, ctx]:
    tidy rows (direction, window, lens_influence, model_influence), each the mean KL over the window's tokens:
    KL(lens(h) || lens(r(h))) for the lens, KL(model(x) || model with r at the stream (x)) for the model."""
    s, k = basis.stream, basis.vectors.shape[1]
    on_lens, on_model = [], []  # [k, batch] per batch of windows, kept on the device
    on_device = windows.to(model.embed.weight.device)  # once: a copy per batch would wait for the device
    for start in tqdm(range(0, len(windows), batch), desc="influence", disable=not progress):
        tokens = on_device[start: start + batch]
        clean, cache = model.run_with_cache(tokens, names_filter=[s.hook_name(model.cfg.n_layers)])
        on_lens.append(lens_influence(lens, cache.stream(s), s, basis.vectors, basis.mean).mean(-1))
        model_kl = []
        for j in range(k):
            with ablate_subspace(model, s, basis.vectors[:, j], basis.mean):
                model_kl.append(metrics.forward_kl(clean, model(tokens)).mean(-1))
        on_model.append(torch.stack(model_kl).float())
    if not on_lens:
        return pd.DataFrame(columns=["direction", "window", "lens_influence", "model_influence"])
    lens_values = torch.cat(on_lens, 1).cpu().tolist()  # [k][window], to the host once
    model_values = torch.cat(on_model, 1).cpu().tolist()
    return pd.DataFrame([{"direction": j, "window": w, "lens_influence": lens_values[j][w],
                          "model_influence": model_values[j][w]}
                         for b0 in range(0, len(windows), batch) for j in range(k) for w in range(b0, min(b0 + batch, len(windows)))])


def causal_fidelity(model: HookedTransformer, lens: Lens, windows: torch.Tensor, stream: int | str | Stream, k: int,
                    *, basis: CausalBasis | None = None, batch: int = 8, max_iter: int = 50, tol: float = 1e-4,
                    progress: bool = False) -> pd.DataFrame:
    """One row per direction of the lens's causal basis at `stream`: direction, lens_influence (the CBE
    objective), model_influence (nats, means over every token of `windows` [n_windows, ctx]).

    The basis is extracted from these windows unless `basis` (e.g. from other windows) is given. `.attrs`:
    spearman (the rank correlation of the two influences across directions), stream, n_windows, n_tokens.
    """
    if basis is None:
        hiddens = stream_hiddens(model, windows, stream, batch)
        basis = extract_causal_bases(lens, hiddens, k, stream=stream, max_iter=max_iter, tol=tol, progress=progress)
    tidy = influence_windows(model, lens, windows, basis, batch=batch, progress=progress)
    table = tidy.groupby("direction", sort=True)[["lens_influence", "model_influence"]].mean().reset_index()
    rho = metrics.spearman(torch.tensor(table["lens_influence"].to_numpy()), torch.tensor(table["model_influence"].to_numpy()))
    table.attrs.update(spearman=float(rho), stream=str(basis.stream), n_windows=int(len(windows)),
                       n_tokens=int(windows.numel()))
    return table

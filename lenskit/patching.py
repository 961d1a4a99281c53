"""Activation patching: run one input, splice in activations recorded on another, and measure what moves.

Clean -> corrupted ("denoising"): run the corrupted prompt, copy in one activation from the clean run,
and see how much of the clean behaviour comes back. Corrupted -> clean ("noising") is the reverse:
run the clean prompt and copy in the corrupted activation, to see what breaks it.

>>> metric = logit_diff(model.to_tokens(" Paris")[0, 0], model.to_tokens(" Rome")[0, 0])
>>> df = activation_patching(model, clean, corrupted, metric, sites=["resid_pre", "attn_out", "head"])
>>> df.pivot(index="layer", columns="position", values="normalized")   # or lenses.plots.patching_heatmap(df)

Sites: the residual stream ("resid_pre", "resid_mid", "resid_post") and the sublayer writes
("attn_out", "mlp_out") of each block, and each attention head ("head", through its `hook_z`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence, Union

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .cache import ActivationCache, hook_name
from .hooks import HookFn
from .model import HookedTransformer, TokensLike

Metric = Callable[[torch.Tensor], Union[torch.Tensor, float]]  # logits [batch, pos, d_vocab] -> scalar
SITES = {"resid_pre": "resid_pre", "resid_mid": "resid_mid", "resid_post": "resid_post",
         "attn_out": "attn_out", "mlp_out": "mlp_out", "head": "z"}
DIRECTIONS = ("clean->corrupted", "corrupted->clean")


# ------------------------------------------------------------------------------------------ metrics
def logit_diff(token_a: int, token_b: int, position: int = -1) -> Metric:
    """logit[token_a] - logit[token_b] at `position`, averaged over the batch.

    The usual patching metric: e.g. the right answer against the answer the corrupted prompt points to.
    """
    a, b = int(token_a), int(token_b)
    if a < 0 or b < 0:
        raise ValueError(f"logit_diff needs token ids >= 0, got {a} and {b}")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        if max(a, b) >= logits.shape[-1]:
            raise ValueError(f"logit_diff({a}, {b}): token id {max(a, b)} is outside the vocabulary [0, {logits.shape[-1]})")
        return (logits[:, position, a] - logits[:, position, b]).mean()

    metric.__name__ = f"logit_diff({a}, {b})"
    return metric


def next_token_loss(tokens: torch.Tensor) -> Metric:
    """Mean cross-entropy (nats) of predicting `tokens[:, 1:]` from the logits at positions `:-1`."""
    targets = tokens[:, 1:] if tokens.ndim == 2 else tokens[None, 1:]
    if targets.shape[1] == 0:
        raise ValueError("a loss needs at least two tokens (a position with a next token)")

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.to(logits.device).flatten())

    metric.__name__ = "loss"
    return metric


# -------------------------------------------------------------------------------------------- hooks
def patching_hooks(
    model: HookedTransformer,
    source: ActivationCache,
    site: str,
    layer: int,
    *,
    positions: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
) -> list[tuple[str, HookFn]]:
    """Hooks that overwrite `site` of block `layer` with the activation recorded in `source`.

    positions: only these positions (default all; an empty list patches nothing).
    heads: for site "head", only these heads (default all).
    The input the hooks run on must have the same shape as the one `source` was recorded on.
    """
    if site not in SITES:
        raise ValueError(f"unknown patching site {site!r}; expected one of {', '.join(SITES)}")
    n_layers = model.cfg.n_layers
    if not (isinstance(layer, int) and not isinstance(layer, bool) and 0 <= layer < n_layers):
        raise IndexError(f"layer {layer!r} is out of range; the model has {n_layers} blocks (layers 0..{n_layers - 1})")
    name = hook_name(SITES[site], layer)
    if name not in source:
        raise KeyError(f"{name!r} is not in the source cache; record it (run_with_cache without a names_filter)")
    if heads is not None and site != "head":
        raise ValueError(f"heads= applies to the 'head' site only, not {site!r}")
    heads = [heads] if isinstance(heads, int) else heads
    if heads is not None:
        bad = [h for h in heads if not 0 <= h < model.cfg.n_heads]
        if bad:
            raise IndexError(f"head {bad[0]} is out of range; block {layer} has {model.cfg.n_heads} heads (0..{model.cfg.n_heads - 1})")
    positions = [positions] if isinstance(positions, int) else positions
    value = source[name]

    def patch(x: torch.Tensor, hook) -> torch.Tensor:
        if x.shape != value.shape:
            raise ValueError(f"patching {name}: the run has shape {tuple(x.shape)} but the source was recorded "
                             f"with {tuple(value.shape)}; clean and corrupted inputs must have the same shape")
        if positions is not None and any(not -x.shape[1] <= p < x.shape[1] for p in positions):
            raise IndexError(f"patch positions {list(positions)} are out of range for an input of {x.shape[1]} positions")
        mask = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
        mask[slice(None) if positions is None else list(positions)] = True
        mask = mask.view(1, -1, *[1] * (x.ndim - 2))  # [1, pos, 1, ...]
        if heads is not None:  # z: [batch, pos, head, d_head]
            head_mask = torch.zeros(x.shape[2], dtype=torch.bool, device=x.device)
            head_mask[list(heads)] = True
            mask = mask & head_mask.view(1, 1, -1, 1)
        return torch.where(mask, value.to(x.dtype), x)

    return [(name, patch)]


# ---------------------------------------------------------------------------------------- the sweep
@torch.no_grad()
def activation_patching(
    model: HookedTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric | str,
    *,
    sites: str | Iterable[str] = ("resid_pre",),
    per_position: bool = True,
    direction: str = "clean->corrupted",
    progress: bool = True,
) -> pd.DataFrame:
    """Patch each site of each layer (and each head, and each position if `per_position`), one at a time.

    metric: a callable on logits [batch, pos, d_vocab] returning a scalar (see `logit_diff`), or "loss":
    the mean next-token loss on the clean tokens.
    direction: "clean->corrupted" runs the corrupted input with clean activations patched in;
    "corrupted->clean" runs the clean input with corrupted activations patched in.

    Returns one row per patch: site, layer, position (<NA> when all positions were patched at once),
    head (<NA> except for site "head"), metric, and normalized = (metric - base) / (source - base),
    where base is the metric of the unpatched run and source that of the run the activations come from:
    0 means the patch changed nothing, 1 means it moved the metric all the way to the source run.
    `df.attrs` holds clean_metric, corrupted_metric, direction and metric (its name).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; expected one of {', '.join(DIRECTIONS)}")
    clean, corrupted = model.validate_tokens(clean), model.validate_tokens(corrupted)
    if clean.shape != corrupted.shape:
        raise ValueError(f"clean tokens have shape {tuple(clean.shape)} but corrupted {tuple(corrupted.shape)}; "
                         "patching needs aligned inputs of the same length")
    if isinstance(metric, str):
        if metric != "loss":
            raise ValueError(f"metric must be a callable on logits or 'loss', got {metric!r}")
        metric = next_token_loss(clean)
    sites = [sites] if isinstance(sites, str) else list(sites)
    unknown = [s for s in sites if s not in SITES]
    if unknown or not sites:
        raise ValueError(f"unknown patching site {unknown[0] if unknown else None!r}; expected some of {', '.join(SITES)}")

    source_tokens, run_tokens = (clean, corrupted) if direction == "clean->corrupted" else (corrupted, clean)
    names = [hook_name(SITES[s], layer) for s in sites for layer in range(model.cfg.n_layers)]
    source_logits, source_cache = model.run_with_cache(source_tokens, names_filter=names)
    base_logits = model(run_tokens)
    source_m, base_m = float(metric(source_logits)), float(metric(base_logits))
    clean_m, corrupted_m = (source_m, base_m) if direction == "clean->corrupted" else (base_m, source_m)

    n_pos, n_heads = clean.shape[1], model.cfg.n_heads
    jobs = []  # (site, layer, position or None, head or None)
    for site in sites:
        for layer in range(model.cfg.n_layers):
            for head in (range(n_heads) if site == "head" else [None]):
                for position in (range(n_pos) if per_position else [None]):
                    jobs.append((site, layer, position, head))

    rows = []
    for site, layer, position, head in tqdm(jobs, desc="patching", disable=not progress, leave=False):
        hooks = patching_hooks(model, source_cache, site, layer, positions=position, heads=head)
        m = float(metric(model.run_with_hooks(run_tokens, fwd_hooks=hooks)))
        rows.append({"site": site, "layer": layer, "position": position, "head": head, "metric": m})
    df = pd.DataFrame(rows, columns=["site", "layer", "position", "head", "metric"])
    df["position"] = df["position"].astype("Int64")
    df["head"] = df["head"].astype("Int64")
    span = source_m - base_m
    df["normalized"] = (df["metric"] - base_m) / span if span != 0 else float("nan")
    df.attrs.update(clean_metric=clean_m, corrupted_metric=corrupted_m, direction=direction,
                    metric=getattr(metric, "__name__", "metric"))
    return df

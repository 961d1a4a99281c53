"""Activation patching: run one input, splice in activations recorded on another, and measure what moves.

Clean -> corrupted ("denoising"): run the corrupted prompt, copy in one activation from the clean run,
and see how much of the clean behaviour comes back. Corrupted -> clean ("noising") is the reverse:
run the clean prompt and copy in the corrupted activation, to see what breaks it.

>>> clean = model.to_tokens("def f(self, name):\\n    self.name =")
>>> corrupted = model.to_tokens("def f(self, path):\\n    self.name =")     # the same length: 12 tokens
>>> metric = logit_diff(model.to_single_token(" name"), model.to_single_token(" path"))
>>> df = activation_patching(model, clean, corrupted, metric, sites=["resid_pre", "attn_out", "head"], progress=False)
>>> grid = df.query("site == 'resid_pre'").pivot(index="layer", columns="position", values="normalized")
>>> grid.loc[0].round(2).tolist()      # or lenses.plots.patching_heatmap(df); before block 0, only position 5 differs
[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]

Sites: the points of each block's stream (`lenskit.observe.stream.POINTS`: "resid_pre", "attn_out", "resid_mid",
"mlp_out", "resid_post"), and per attention head its output ("head", through `hook_z`), its query, key and value
("q", "k", "v") and its pattern ("pattern", by destination position; `patching_hooks(..., sources=)` also picks
source positions). Under grouped-query attention "k" and "v" have one entry per key/value head: head j of a k or
v patch is kv head j, which query heads j * group .. (j + 1) * group - 1 read (group = n_heads / n_kv_heads).
Linear-attention blocks (Qwen 3.5) have no head sites. `patching_hooks` also takes any `Stream`, e.g.
`patching_hooks(model, cache, Stream(3, "resid_mid"))`.

`lenskit.intervene.attribution.attribution_patching` (which builds on this module) estimates the same table from one forward and one backward pass.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Sequence, Union

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm import tqdm  # tqdm.auto warns "IProgress not found" in kernels without ipywidgets

from ..model import HookedTransformer, TokensLike
from ..observe.cache import ActivationCache, hook_name
from ..observe.hooks import HookFn
from ..observe.stream import POINTS, Stream, check_layer
from .masks import check_positions, indices, positions_here, replace_along

Metric = Callable[[torch.Tensor], Union[torch.Tensor, float]]  # logits [batch, pos, d_vocab] -> scalar
HEAD_SITES = {"head": "z", "q": "q", "k": "k", "v": "v", "pattern": "pattern"}  # site -> its attn hook's short name
SITES = (*POINTS, *HEAD_SITES)  # the stream points of a block, and its heads' sites
KV_SITES = ("k", "v")  # one entry per key/value head
# Which axis of a site's activation each selection of a patch indexes.
LAYOUTS = {
    "stream": {"positions": 1},  # [batch, pos, d_model]
    "vector": {"positions": 1, "heads": 2},  # hook_q, hook_z [batch, pos, head, d_head]; hook_k, hook_v kv_head
    "pattern": {"heads": 1, "positions": 2, "sources": 3},  # [batch, head, query_pos, key_pos]
}
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
def site_hook_name(site: str | Stream, layer: int | None, n_layers: int) -> str:
    """The hook a patch of `site` in block `layer` overwrites; a Stream carries its own layer."""
    if isinstance(site, Stream):
        if layer is not None:
            raise ValueError(f"{site} already names its layer; drop layer={layer!r}")
        return site.hook_name(n_layers)
    if site not in SITES:
        raise ValueError(f"unknown patching site {site!r}; expected one of {', '.join(SITES)}")
    layer = check_layer(layer, n_layers)
    return hook_name(HEAD_SITES[site], layer) if site in HEAD_SITES else Stream(layer, site).hook_name(n_layers)


def layout_of(site: str | Stream) -> str:
    """The key of `LAYOUTS` that says how `site`'s activation is laid out."""
    return "pattern" if site == "pattern" else "vector" if site in HEAD_SITES else "stream"


def splice(x: torch.Tensor, value: torch.Tensor, layout: str, *, positions: Sequence[int] | None = None,
           heads: Sequence[int] | None = None, sources: Sequence[int] | None = None) -> torch.Tensor:
    """x with the entries at `positions`, `heads` and `sources` (each: all when None) taken from `value`.

    layout: a key of `LAYOUTS`, which says the axis each selection indexes; positions are destination (query)
    positions in an attention pattern, sources its key positions.
    """
    picks = {"positions": positions, "heads": heads, "sources": sources}
    axes = LAYOUTS[layout]
    stray = [k for k, v in picks.items() if v is not None and k not in axes]
    if stray:
        raise ValueError(f"a {layout} activation has no {stray[0]} to select; it takes {', '.join(axes)}")
    return replace_along(x, value, {axis: picks[k] for k, axis in axes.items()})


def n_heads_of(model: HookedTransformer, site: str, layer: int) -> int:
    """The heads `site` has in block `layer`: key/value heads for "k" and "v", query heads for the others."""
    return model.cfg.n_kv_heads_of(layer) if site in KV_SITES else model.cfg.n_heads


def check_heads(model: HookedTransformer, site: str, layer: int, heads: Sequence[int] | None = None) -> None:
    """ValueError if block `layer` has no heads (a linear-attention or Mamba-2 block, or none at all); IndexError for
    a head out of range."""
    if not model.cfg.has_heads(layer):
        kind = getattr(model.blocks[layer].attn, "LAYER_TYPE", "linear-attention")
        full = [l for l in range(model.cfg.n_layers) if model.cfg.has_heads(l)]
        raise ValueError(f"site {site!r}: block {layer} is a {kind} layer, which has no attention heads; patch its "
                         f"'attn_out', or the heads of a full-attention block ({full})")
    n = n_heads_of(model, site, layer)
    bad = [h for h in heads or () if not 0 <= h < n]
    if bad:
        what = "key/value heads" if site in KV_SITES and n != model.cfg.n_heads else "heads"
        raise IndexError(f"head {bad[0]} is out of range; block {layer} has {n} {what} for site {site!r} (0..{n - 1})")


def check_aligned(name: str, x: torch.Tensor, value: torch.Tensor) -> None:
    """ValueError unless the run's activation `x` at hook `name` has the shape of the recorded `value`."""
    if x.shape != value.shape:
        raise ValueError(f"patching {name}: the run has shape {tuple(x.shape)} but the source was recorded "
                         f"with {tuple(value.shape)}; clean and corrupted inputs must have the same shape")


def patching_hooks(
    model: HookedTransformer,
    source: ActivationCache,
    site: str | Stream,
    layer: int | None = None,
    *,
    positions: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    sources: int | Sequence[int] | None = None,
) -> list[tuple[str, HookFn]]:
    """Hooks that overwrite `site` of block `layer` (or the stream `site`) with the activation recorded in `source`.

    positions: only these positions (default all; an empty list patches nothing); for "pattern", destination
    (query) positions.
    heads: for a head site, only these heads (default all); kv heads for "k" and "v".
    sources: for "pattern", only these source (key) positions (default all).
    The input the hooks run on must have the same shape as the one `source` was recorded on.
    """
    name = site_hook_name(site, layer, model.cfg.n_layers)
    if heads is not None and site not in HEAD_SITES:
        raise ValueError(f"heads= applies to the head sites ({', '.join(HEAD_SITES)}) only, not {site!r}")
    if sources is not None and site != "pattern":
        raise ValueError(f"sources= (key positions) applies to the 'pattern' site only, not {site!r}")
    heads, positions, sources = (None if s is None else indices(s, what)
                                 for s, what in ((heads, "heads"), (positions, "positions"), (sources, "sources")))
    if site in HEAD_SITES:
        layer = check_layer(layer, model.cfg.n_layers)
        check_heads(model, site, layer, heads)
    if name not in source:
        raise KeyError(f"{name!r} is not in the source cache; record it (run_with_cache without a names_filter)")
    value, layout = source[name], layout_of(site)
    pos_axis = LAYOUTS[layout]["positions"]

    def patch(x: torch.Tensor, hook) -> torch.Tensor:
        check_aligned(name, x, value)
        here = positions_here(positions, x.shape[pos_axis], "patch")
        check_positions(sources, x.shape[-1], "patch source")  # key positions: every key so far, also under a cache
        return splice(x, value, layout, positions=here, heads=heads, sources=sources)

    return [(name, patch)]


def run_patches(model: HookedTransformer, tokens: torch.Tensor, metric: Metric,
                patches: Iterable[list[tuple[str, HookFn]]], *, total: int | None = None,
                progress: bool | None = True) -> list[torch.Tensor | float]:
    """The metric of one run of `tokens` per entry of `patches` (each a list of hooks), in order, without gradients.

    progress: a bar (tqdm); None shows it only on a terminal.
    """
    bar = tqdm(patches, total=total, desc="patching", disable=None if progress is None else not progress, leave=False)
    with torch.no_grad():
        return [metric(model.run_with_hooks(tokens, fwd_hooks=hooks)) for hooks in bar]


def one_number(metric: Metric, what: str) -> Metric:
    """`metric`, refusing in one line a result that is not one number (a 0-d tensor or a float): a vector of them
    (one per sequence, say) would otherwise fail inside float() or autograd with a message about something else."""

    @functools.wraps(metric)
    def checked(logits: torch.Tensor) -> torch.Tensor:
        m = metric(logits)
        if isinstance(m, torch.Tensor) and m.ndim == 0 or isinstance(m, (int, float)) and not isinstance(m, bool):
            return m
        got = f"a tensor of shape {tuple(m.shape)}" if isinstance(m, torch.Tensor) else f"{type(m).__name__} {m!r:.40}"
        raise ValueError(f"{what}: the metric must return one number per run (a 0-d tensor), got {got}; reduce it, "
                         "e.g. with .mean() over the batch")

    return checked


def checked_sweep(model: HookedTransformer, clean: TokensLike, corrupted: TokensLike, metric: Metric | str,
                  sites: str | Iterable[str], direction: str, allowed: Iterable[str], what: str) -> tuple:
    """(clean, corrupted, metric, sites) of a patching sweep, checked: a known direction, aligned token ids of one
    shape, a callable metric ("loss": the clean tokens' next-token loss) and sites among `allowed`. Shared by
    activation and attribution patching (`what` names which in the messages)."""
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
    elif not callable(metric):
        raise TypeError(f"metric must be a callable on logits or 'loss', got {type(metric).__name__}")
    metric = one_number(metric, what)
    sites = [sites] if isinstance(sites, str) else list(sites)
    allowed = tuple(allowed)
    unknown = [s for s in sites if s not in allowed]
    if unknown or not sites:
        raise ValueError(f"unknown {what} site {unknown[0] if unknown else None!r}; expected some of {', '.join(allowed)}")
    return clean, corrupted, metric, sites


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

    Returns one row per patch: site, layer, position (<NA> when all positions were patched at once; for
    "pattern", the destination position), head (<NA> except for the head sites; a kv head for "k" and "v"),
    metric, and normalized = (metric - base) / (source - base),
    where base is the metric of the unpatched run and source that of the run the activations come from:
    0 means the patch changed nothing, 1 means it moved the metric all the way to the source run.
    `df.attrs` holds clean_metric, corrupted_metric, direction and metric (its name).
    """
    clean, corrupted, metric, sites = checked_sweep(model, clean, corrupted, metric, sites, direction, SITES, "patching")

    jobs = []  # (site, layer, position or None, head or None)
    for site in sites:
        for layer in range(model.cfg.n_layers):
            if site in HEAD_SITES and not model.cfg.has_heads(layer):
                continue  # no attention heads there (patching_hooks refuses them)
            for head in (range(n_heads_of(model, site, layer)) if site in HEAD_SITES else [None]):
                for position in (range(clean.shape[1]) if per_position else [None]):
                    jobs.append((site, layer, position, head))

    source_tokens, run_tokens = (clean, corrupted) if direction == "clean->corrupted" else (corrupted, clean)
    names = list(dict.fromkeys(site_hook_name(site, layer, model.cfg.n_layers) for site, layer, _, _ in jobs))
    source_logits, source_cache = model.run_with_cache(source_tokens, names_filter=names)
    base_logits = model(run_tokens)
    source_m, base_m = float(metric(source_logits)), float(metric(base_logits))
    clean_m, corrupted_m = (source_m, base_m) if direction == "clean->corrupted" else (base_m, source_m)

    patches = (patching_hooks(model, source_cache, site, layer, positions=position, heads=head)
               for site, layer, position, head in jobs)
    metrics = run_patches(model, run_tokens, metric, patches, total=len(jobs), progress=progress)
    rows = [{"site": site, "layer": layer, "position": position, "head": head, "metric": float(m)}
            for (site, layer, position, head), m in zip(jobs, metrics)]
    df = pd.DataFrame(rows, columns=["site", "layer", "position", "head", "metric"])
    df["position"] = df["position"].astype("Int64")
    df["head"] = df["head"].astype("Int64")
    span = source_m - base_m
    df["normalized"] = (df["metric"] - base_m) / span if span != 0 else float("nan")
    df.attrs.update(clean_metric=clean_m, corrupted_metric=corrupted_m, direction=direction,
                    metric=getattr(metric, "__name__", "metric"))
    return df

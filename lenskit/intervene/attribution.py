"""Attribution patching: activation patching's linear estimate, from one forward and one backward pass.

Patching site a of the run with the source's activation moves the metric by about

    (a_source - a_run) . d metric / d a   (the gradient taken on the unpatched run)

summed over the batch and the activation's features (d_model; d_head for one head's q, k, v or z; the source
positions for one head's pattern at one destination). Every site,
layer, position and head comes from the same two passes, where `activation_patching` runs the model once per patch.
The estimate is exact for a metric linear in the activation; where the model bends between the two activations
(attention patterns, norms, the metric itself) it can be far off, so check the sites that matter with
`activation_patching`.

>>> from lenskit.intervene.patching import logit_diff
>>> clean = model.to_tokens("def f(self, name):\\n    self.name =")
>>> corrupted = model.to_tokens("def f(self, path):\\n    self.name =")     # the same length: 12 tokens
>>> metric = logit_diff(model.to_single_token(" name"), model.to_single_token(" path"))
>>> df = attribution_patching(model, clean, corrupted, metric, sites=["resid_pre", "head"])
>>> grid = df.query("site == 'resid_pre'").pivot(index="layer", columns="position", values="normalized")
>>> grid.loc[0].round(2).tolist()      # the layout of activation_patching, whose patch here gives 1.0 at position 5
[0.0, 0.0, 0.0, 0.0, 0.0, 0.88, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

from typing import Iterable

import pandas as pd
import torch

from ..model import HookedTransformer, TokensLike
from ..observe.backward import check_gradients_possible
from .patching import HEAD_SITES, SITES, Metric, checked_sweep, site_hook_name

STREAM_START = ("hook_embed", "hook_pos_embed")  # where the residual stream begins: the gradient is taken w.r.t. these


def activations_and_gradients(model: HookedTransformer, tokens: TokensLike, metric: Metric,
                              names: Iterable[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One forward and one backward pass on `tokens`: (metric, activations, gradients of the metric) at `names`.

    The gradients come from backward hooks on `names`. The backward runs from the metric to the start of the
    stream only (`torch.autograd.grad`), so it works on a frozen model and leaves every parameter's `.grad` as it
    was. A point the gradient never reaches (the metric does not depend on it) gets zeros.
    """
    check_gradients_possible("attribution patching")
    names = model.hook_names(list(names))
    acts: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    starts: list[torch.Tensor] = []

    def start(x: torch.Tensor, hook) -> torch.Tensor:
        x = x.detach().requires_grad_(True)  # so gradients flow even when no parameter requires one
        starts.append(x)
        return x

    def keep(x: torch.Tensor, hook) -> None:
        acts[hook.name] = x.detach()

    def keep_grad(g: torch.Tensor, hook) -> None:
        grads[hook.name] = g.detach()

    begin = [(n, start) for n in STREAM_START if n in model.hook_dict]
    with torch.enable_grad(), model.hooks([*begin, *((n, keep) for n in names)], [(n, keep_grad) for n in names]):
        m = metric(model(tokens))
        if not (isinstance(m, torch.Tensor) and m.ndim == 0 and m.requires_grad):
            raise ValueError(f"attribution needs a metric that returns a scalar tensor computed from the logits "
                             f"(so it has a gradient), got {type(m).__name__} {getattr(m, 'shape', '')}")
        torch.autograd.grad(m, starts, allow_unused=True)
    return m.detach(), acts, {n: grads[n] if n in grads else torch.zeros_like(acts[n]) for n in names}


def attribution_patching(
    model: HookedTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric | str,
    *,
    sites: str | Iterable[str] = ("resid_pre",),
    per_position: bool = True,
    direction: str = "clean->corrupted",
) -> pd.DataFrame:
    """`activation_patching`'s table, estimated: each row's metric is the unpatched run's plus the linear estimate.

    Arguments and rows are those of `activation_patching` (site, layer, position, head, metric, normalized), in
    the same order, with one more column, attribution = metric - base: the estimated change. "clean->corrupted"
    takes the gradient on the corrupted run and the difference clean - corrupted; "corrupted->clean" the reverse.
    `df.attrs` holds clean_metric, corrupted_metric (both measured), direction, metric and method="attribution".
    """
    check_gradients_possible("attribution patching")  # before the source run, not after it
    clean, corrupted, metric, sites = checked_sweep(model, clean, corrupted, metric, sites, direction, SITES,
                                                    "attribution patching")

    n_layers = model.cfg.n_layers
    layers = {s: [l for l in range(n_layers) if not (s in HEAD_SITES and not model.cfg.has_heads(l))] for s in sites}
    names = sorted({site_hook_name(s, l, n_layers) for s in sites for l in layers[s]})
    source_tokens, run_tokens = (clean, corrupted) if direction == "clean->corrupted" else (corrupted, clean)
    with torch.no_grad():
        source_logits, source = model.run_with_cache(source_tokens, names_filter=names)
        source_m = float(metric(source_logits))
    base, acts, grads = activations_and_gradients(model, run_tokens, metric, names)
    base_m = float(base)
    clean_m, corrupted_m = (source_m, base_m) if direction == "clean->corrupted" else (base_m, source_m)

    rows = []
    for site in sites:
        for layer in layers[site]:
            name = site_hook_name(site, layer, n_layers)
            delta = source[name].to(acts[name].device, torch.float64) - acts[name].double()
            attr = (delta * grads[name].double()).sum(dim=(0, -1))  # [pos]; q, k, v, z [pos, head]; pattern [head, pos]
            attr = attr.T if site == "pattern" else attr  # pattern: by destination position, as activation_patching
            attr = attr if per_position else attr.sum(0, keepdim=True)
            attr = attr if site in HEAD_SITES else attr[:, None]  # [pos or 1, head or 1]
            for h in range(attr.shape[1]):
                for p in range(attr.shape[0]):
                    rows.append({"site": site, "layer": layer, "position": p if per_position else None,
                                 "head": h if site in HEAD_SITES else None, "attribution": float(attr[p, h])})
    df = pd.DataFrame(rows, columns=["site", "layer", "position", "head", "attribution"])
    df["position"] = df["position"].astype("Int64")
    df["head"] = df["head"].astype("Int64")
    df.insert(4, "metric", base_m + df["attribution"])
    span = source_m - base_m
    df.insert(5, "normalized", df["attribution"] / span if span != 0 else float("nan"))
    df.attrs.update(clean_metric=clean_m, corrupted_metric=corrupted_m, direction=direction,
                    metric=getattr(metric, "__name__", "metric"), method="attribution")
    return df

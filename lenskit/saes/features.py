"""SAE features as targets: ablate, steer and patch them, attribute to them, and find where they fire.

A `Feature(sae, i)` (or several indices) is an ablation target of `lenskit.intervene.interventions.ablation_hooks`:
it replaces `acts_post[..., i]` at `f"{sae.hook_name}.hook_sae_acts_post"`, so it needs the SAE spliced in:

>>> from lenskit.intervene.interventions import ablation_hooks
>>> with model.saes([sae]):   # with the error term, the only change is the feature's
...     hooks = ablation_hooks(model, Feature(sae, 168), mode="mean", reference=tokens)
...     ablated = model.run_with_hooks(prompt, fwd_hooks=hooks)
>>> ablated.shape
torch.Size([1, 13, 4096])

Steering adds alpha * W_dec[i] at the SAE's output hook and needs no splice (`steering_hooks`). Patching copies
the feature's activation from a source cache (`feature_patching_hooks`); attribution patching estimates every
feature's effect at once (`feature_attribution`); `feature_logit_attribution` is the features' direct effect on
logits; `top_activations` lists the tokens and contexts where features fire most, as a tidy DataFrame.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..intervene.attribution import activations_and_gradients
from .sae import SAE

if TYPE_CHECKING:
    from ..model import HookedTransformer
    from ..observe.cache import ActivationCache


@dataclass(frozen=True, eq=False)
class Feature:
    """Latent(s) `index` of `sae`: `Feature(sae, 7)` or `Feature(sae, [7, 9])`."""

    sae: SAE
    index: tuple[int, ...]

    def __init__(self, sae: SAE, index: int | Iterable[int]) -> None:
        idx = (int(index),) if isinstance(index, int) else tuple(int(i) for i in index)
        if not idx:
            raise ValueError("Feature needs at least one latent index")
        bad = [i for i in idx if not -sae.d_sae <= i < sae.d_sae]
        if bad:
            raise IndexError(f"feature {bad[0]} is out of range for an SAE of d_sae={sae.d_sae}")
        object.__setattr__(self, "sae", sae)
        object.__setattr__(self, "index", tuple(sorted({i % sae.d_sae for i in idx})))

    @property
    def acts_name(self) -> str:
        """The hook point of its activations while the SAE is spliced."""
        return f"{self.sae.hook_name}.hook_sae_acts_post"

    @property
    def direction(self) -> torch.Tensor:
        """Its decoder direction(s) W_dec[i]: [d_out] for one latent, [n, d_out] for several."""
        d = self.sae.W_dec[list(self.index)]
        return d[0] if len(self.index) == 1 else d

    def __repr__(self) -> str:
        i = self.index[0] if len(self.index) == 1 else list(self.index)
        return f"Feature({self.sae.hook_name}, {i})"


def check_spliced(model: HookedTransformer, feature: Feature) -> str:
    if feature.acts_name not in model.hook_dict:
        raise KeyError(f"{feature!r}: its activations ({feature.acts_name}) exist only while its SAE is spliced in; "
                       "work inside `with model.saes([sae]):`")
    return feature.acts_name


def steering_hooks(feature: Feature, alpha: float | torch.Tensor, positions: Sequence[int] | None = None) -> list:
    """Hooks that add alpha * W_dec[i] (each latent of the feature) at the SAE's output hook, at `positions`
    (default all). The SAE need not be spliced."""
    sae = feature.sae
    if sae.hook_name_out is None:
        raise ValueError(f"{feature!r}: its SAE names no hook; load it with hook=")
    direction = sae.W_dec[list(feature.index)].sum(0)  # [d_out]

    def steer(x: torch.Tensor, hook) -> torch.Tensor:
        add = (alpha * direction.to(x.device, torch.float32)).to(x.dtype)
        add = add.reshape(x.shape[2:]) if x.dim() > 3 else add  # per-head hooks ([.., head, d_head])
        out = x.clone()
        sel = slice(None) if positions is None else list(positions)
        out[:, sel] += add
        return out

    return [(sae.hook_name_out, steer)]


def feature_patching_hooks(model: HookedTransformer, source: ActivationCache, feature: Feature,
                           positions: Sequence[int] | None = None) -> list:
    """Hooks that set the feature's activation to the one recorded in `source` (a cache taken with the SAE
    spliced in, on an input of the same shape), at `positions` (default all)."""
    name = check_spliced(model, feature)
    if name not in source:
        raise KeyError(f"{name!r} is not in the source cache; record it with run_with_cache inside model.saes([sae])")
    value, idx = source[name], list(feature.index)

    def patch(acts: torch.Tensor, hook) -> torch.Tensor:
        if acts.shape != value.shape:
            raise ValueError(f"patching {feature!r}: the run has shape {tuple(acts.shape)}, the source {tuple(value.shape)}")
        out = acts.clone()
        sel = slice(None) if positions is None else list(positions)
        out[:, sel, ..., idx] = value[:, sel, ..., idx].to(out.device, out.dtype)
        return out

    return [(name, patch)]


def feature_attribution(model: HookedTransformer, clean: torch.Tensor, corrupted: torch.Tensor,
                        metric: Callable[[torch.Tensor], torch.Tensor], saes: Sequence[SAE], *,
                        per_position: bool = False, top: int | None = None) -> pd.DataFrame:
    """Attribution patching per feature: (acts_clean - acts_corrupted) . d metric / d acts, the gradient taken on
    the corrupted run with every SAE spliced in with its error term. One row per (hook, feature[, position]),
    sorted by |attribution|, `top` rows at most: hook, feature, position, attribution."""
    with model.saes(saes, use_error_term=True):
        names = [f"{s.hook_name}.hook_sae_acts_post" for s in saes]
        with torch.no_grad():
            _, source = model.run_with_cache(clean, names_filter=names)
        _, acts, grads = activations_and_gradients(model, corrupted, metric, names)
    frames = []
    for sae, name in zip(saes, names):
        attr = ((source[name].double() - acts[name].double()) * grads[name].double()).sum(0)  # [pos, d_sae]
        attr = attr if per_position else attr.sum(0, keepdim=True)
        pos, feat = torch.nonzero(attr, as_tuple=True)
        frames.append(pd.DataFrame({"hook": sae.hook_name, "feature": feat.numpy(),
                                    "position": pos.numpy() if per_position else pd.NA,
                                    "attribution": attr[pos, feat].numpy()}))
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["hook", "feature", "position", "attribution"])
    df = df.reindex(df["attribution"].abs().sort_values(ascending=False).index).reset_index(drop=True)
    return df.head(top) if top is not None else df


def feature_logit_attribution(model: HookedTransformer, cache: ActivationCache, sae: SAE, token: int,
                              minus: int | None = None, pos: int = -1, top: int | None = 20) -> pd.DataFrame:
    """Each feature's direct effect on the logit of `token` (minus `minus`) at position `pos`: f_i W_dec[i]
    through the final norm at its cached scale (frozen, as `cache.logit_attrs` does) and the unembedding, for every
    sequence of a cache taken inside `model.saes([sae])`. Rows: batch, feature, activation, attribution."""
    acts = cache[f"{sae.hook_name}.hook_sae_acts_post"][:, pos]  # [batch, d_sae]
    writes = acts[..., None].float() * sae.W_dec.float().to(acts.device)  # [batch, d_sae, d_out]
    stack = writes.permute(1, 0, 2)  # [d_sae, batch, d_model]: one position, as pos_slice=pos says
    attrs = cache.logit_attrs(stack, token, minus, pos_slice=pos).reshape(sae.d_sae, acts.shape[0])
    rows = []
    for b in range(acts.shape[0]):
        live = torch.nonzero(acts[b] > 0).flatten()
        for i in live.tolist():
            rows.append({"batch": b, "feature": i, "activation": float(acts[b, i]), "attribution": float(attrs[i, b])})
    df = pd.DataFrame(rows, columns=["batch", "feature", "activation", "attribution"])
    df = df.reindex(df["attribution"].abs().sort_values(ascending=False).index).reset_index(drop=True)
    return df.head(top) if top is not None else df


@torch.no_grad()
def top_activations(model: HookedTransformer, sae: SAE, tokens: torch.Tensor, features: Sequence[int] | None = None,
                    *, top: int = 10, context: int = 8, batch_size: int = 8) -> pd.DataFrame:
    """Where features fire over a token stream `tokens` [batch, pos]: for each feature (default every one that
    fires), its `top` strongest (sequence, position)s, with the token, the `context` tokens before it, the
    activation and the feature's firing count and rate over the whole stream. Rows sorted by feature, then rank."""
    name = f"{sae.hook_name}.hook_sae_acts_post"
    acts = []
    for start in range(0, tokens.shape[0], batch_size):
        with model.saes([sae]):
            _, cache = model.run_with_cache(tokens[start : start + batch_size], names_filter=[name], return_logits=False)
        acts.append(cache[name].float().cpu())
    a = torch.cat(acts)  # [batch, pos, d_sae]
    flat = a.reshape(-1, a.shape[-1])
    counts = (flat > 0).sum(0)
    feats = torch.nonzero(counts).flatten().tolist() if features is None else list(features)
    n_pos = a.shape[1]
    rows = []
    for i in feats:
        vals, where = flat[:, i].topk(min(top, flat.shape[0]))
        for rank, (v, w) in enumerate(zip(vals.tolist(), where.tolist())):
            if v <= 0:
                break
            b, p = divmod(w, n_pos)
            before = tokens[b, max(0, p - context) : p].tolist()
            rows.append({"feature": i, "rank": rank, "activation": v, "batch": b, "position": p,
                         "token": model.to_string(tokens[b, p : p + 1]) if model.tokenizer else int(tokens[b, p]),
                         "context": model.to_string(before) if model.tokenizer else before,
                         "count": int(counts[i]), "rate": float(counts[i]) / flat.shape[0]})
    return pd.DataFrame(rows, columns=["feature", "rank", "activation", "batch", "position", "token", "context", "count", "rate"])

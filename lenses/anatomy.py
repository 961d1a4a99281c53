"""Residual-stream anatomy: the stream as a sum of writes, each write's direct effect on a logit, norms by layer.

Every family only ever adds to its stream, so the stream at any point is exactly

    embed (+ pos_embed, where positions are learned) + sum over earlier blocks of (attn_out + mlp_out)

(rotary families have no position term: positions enter inside attention; in a parallel block both
writes read resid_pre, and the sum is the same)

and each attention write is itself the sum of its heads (`attn.hook_result`) plus the output bias.
`decompose_resid` returns those parts; `direct_logit_attribution` projects each part on an unembedding
direction through the final norm, linearised; `resid_norms` measures the stream and each write by layer.

>>> logits, cache = model.run_with_cache(tokens, names_filter=lambda name: True)  # includes hook_result
>>> parts = decompose_resid(cache, model.cfg.n_layers, per_head=True)
>>> dla = direct_logit_attribution(model, cache, token=" self", per_head=True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import pandas as pd
import torch

from lenskit import ActivationCache, HookedTransformer, Stream
from lenskit.io.text import single_token_id
from lenskit.observe.cache import hook_name
from lenskit.observe.resid import resid_parts
from lenskit.observe.stream import POINTS as STREAM_POINTS
from lenskit.observe.stream import as_stream

# The points that are the stream itself (the others are writes into it); the stream is a sum of parts there.
POINTS = tuple(p for p in STREAM_POINTS if p.startswith("resid_"))
TokenLike = Union[int, str, torch.Tensor]


@dataclass
class ResidDecomposition:
    """The parts of one residual-stream point. `components` is [component, batch, pos, d_model];
    `labels`, `kinds`, `layers` and `heads` describe each component (layer and head are None where
    they do not apply). Kinds: `embed`, `pos_embed` (learned positions only), `attn`, `mlp`, and with per-head splits `head`
    and `attn_bias` in place of `attn`."""

    components: torch.Tensor
    labels: list[str]
    kinds: list[str]
    layers: list[int | None]
    heads: list[int | None]
    point: str
    layer: int

    def total(self) -> torch.Tensor:
        """The sum of the parts: [batch, pos, d_model], equal to the stream up to float rounding."""
        return self.components.sum(0)

    def to_frame(self) -> pd.DataFrame:
        """One row per (component, batch, position) with the part's L2 norm and RMS (norm / sqrt(d_model))."""
        norm = self.components.float().norm(dim=-1)  # [component, batch, pos]
        c, b, p = norm.shape
        index = pd.MultiIndex.from_product([range(c), range(b), range(p)], names=["c", "batch", "position"])
        frame = index.to_frame(index=False)
        which = frame.pop("c").to_numpy()
        frame["component"] = pd.array(self.labels, dtype=object)[which]
        frame["kind"] = pd.array(self.kinds, dtype=object)[which]
        frame["layer"] = pd.array(self.layers, dtype="Int64")[which]
        frame["head"] = pd.array(self.heads, dtype="Int64")[which]
        frame["norm"] = norm.flatten().cpu().numpy()
        frame["rms"] = frame["norm"] / self.components.shape[-1] ** 0.5
        return frame


def _need(cache: ActivationCache, name: str, why: str) -> torch.Tensor:
    if name not in cache:
        raise KeyError(
            f"{why} needs {name!r}, which this cache does not hold; run model.run_with_cache(tokens) without a "
            "names_filter" + (", or with names_filter=lambda name: True for the per-head hook_result" if "result" in name else "")
        )
    return cache[name]


def stream_in(cache: ActivationCache, s: Stream, why: str) -> torch.Tensor:
    """The cached stream [batch, pos, d_model] at `s`, or a KeyError that says how to cache it."""
    return _need(cache, s.hook_name(cache.n_layers), why)


def location(s: int | str | Stream, point: str | None, n_layers: int) -> Stream:
    """`s` (and `point`) as a resolved Stream at one of `POINTS`, where the stream is a sum of parts."""
    s = as_stream(s, point).resolve(n_layers)
    if s.point not in POINTS:
        raise ValueError(f"{s.point} is a write into the stream, not the stream; point must be one of {', '.join(POINTS)}")
    return s


def decompose_resid(cache: ActivationCache, stream: int | str | Stream, point: str | None = None,
                    per_head: bool = False) -> ResidDecomposition:
    """Split the stream at `stream` (a `Stream`, or a layer with `point`, default resid_pre; an int l alone is
    the stream after l blocks) into the embedding, the position embedding (learned-position families only;
    rotary ones add positions inside attention) and every attention and MLP write before it.

    With `per_head`, each attention write becomes its heads' writes (`attn.hook_result`) plus an
    `attn_bias` part, computed as `attn_out - sum(heads)` so the parts still sum exactly to the stream.
    """
    s = location(stream, point, cache.n_layers)
    parts = resid_parts(cache, s, per_head=per_head)
    return ResidDecomposition(
        components=torch.stack([p.tensor for p in parts]),  # [component, batch, pos, d_model]
        labels=[p.label for p in parts], kinds=[p.kind for p in parts], layers=[p.layer for p in parts],
        heads=[p.head for p in parts], point=s.point, layer=s.layer,
    )


# ------------------------------------------------------------------ attribution
def _token_ids(model: HookedTransformer, token: TokenLike, batch: int) -> torch.Tensor:
    """[batch] token ids from an id, a single-token string, or a [batch] tensor of ids."""
    if isinstance(token, str):
        token = single_token_id(model.tokenizer, token)
    ids = torch.as_tensor(token, dtype=torch.long).flatten()
    if ids.numel() == 1:
        ids = ids.expand(batch)
    if ids.numel() != batch:
        raise ValueError(f"expected one target token or one per sequence ({batch}), got {ids.numel()}")
    if ((ids < 0) | (ids >= model.cfg.d_vocab)).any():
        raise ValueError(f"target token ids {ids.tolist()} are outside the vocabulary [0, {model.cfg.d_vocab})")
    return ids


def _positions(pos: int | Sequence[int] | torch.Tensor, batch: int, n_pos: int) -> torch.Tensor:
    p = torch.as_tensor(pos, dtype=torch.long).flatten()
    p = p.expand(batch) if p.numel() == 1 else p
    if p.numel() != batch:
        raise ValueError(f"expected one position or one per sequence ({batch}), got {p.numel()}")
    if ((p < -n_pos) | (p >= n_pos)).any():
        raise IndexError(f"positions {p.tolist()} are out of range for sequences of {n_pos} tokens")
    return p % n_pos


@torch.no_grad()
def direct_logit_attribution(
    model: HookedTransformer,
    cache: ActivationCache,
    token: TokenLike,
    minus: TokenLike | None = None,
    *,
    pos: int | Sequence[int] | torch.Tensor = -1,
    per_head: bool = False,
) -> pd.DataFrame:
    """Each write's direct contribution to the logit of `token` (or to `logit(token) - logit(minus)`).

    The final norm is linearised at the actual final stream `x`: its scale `s = sqrt(var(x) + eps)`
    (the RMS for RMSNorm) is held fixed, so a part `c` contributes `centre(c) / s * w . u`, with `w` the
    norm's gain (`norm.gain`), `centre` the mean subtraction (LayerNorm only; RMSNorm does not centre) and
    `u` the unembedding direction (`W_U[token] - W_U[minus]`). A LayerNorm's bias contributes its own row,
    `ln_final.bias`; RMSNorm has none. Because centring and the dot product are linear, the rows sum
    exactly to the model's logit (difference), taken before any final soft-cap (which is not linear).
    The approximation is in reading a row as an effect: removing a part would also change `s`, which
    this attribution ignores; it measures what each write says directly, not what it causes downstream.
    For a model with a final logit soft-cap (Gemma 2), attribution is to the pre-cap logits: the rows sum to
    the logit (difference) before the cap, and `attrs["logit"]` is that pre-cap value, not the capped output.
    With `per_head`, a model whose attention output is normalised again before it reaches the stream (Gemma,
    OLMo 2: `ln1_post`) is refused, since its heads' outputs do not add up to the write.

    `pos` is one position, or one per sequence (e.g. each prompt's last real token). Returns one row per
    (batch, component) with `batch, position, component, kind, layer, head, attribution`; the frame's
    `attrs["logit"]` holds the target logit (difference) per sequence, computed from the model itself
    (before any final soft-cap).
    """
    if per_head and model.cfg.norm_placement != "pre":
        raise ValueError(f"per_head attribution is not defined for norm_placement={model.cfg.norm_placement!r}: "
                         "each attention write is normalised (ln1_post) after its heads are summed; use per_head=False")
    final = stream_in(cache, Stream(cache.n_layers), "the final stream")  # [batch, pos, d_model]
    batch, n_pos, d_model = final.shape
    p = _positions(pos, batch, n_pos)
    rows = torch.arange(batch)
    plus_ids = _token_ids(model, token, batch)
    minus_ids = None if minus is None else _token_ids(model, minus, batch)
    direction = model.unembed.weight[plus_ids]  # [batch, d_model]
    if minus_ids is not None:
        direction = direction - model.unembed.weight[minus_ids]
    direction = model.readout.scaled(direction)  # times the logits' scale where the readout has one (Granite)

    parts = decompose_resid(cache, cache.n_layers, per_head=per_head)
    comps = parts.components[:, rows, p].to(direction.dtype)  # [component, batch, d_model]
    x = final[rows, p].to(direction.dtype)  # [batch, d_model]
    ln = model.ln_final
    centred = getattr(ln, "bias", None) is not None  # LayerNorm centres; RMSNorm neither centres nor has a bias
    if centred:  # the mean is subtracted from every part, as it is from their sum
        comps = comps - comps.mean(-1, keepdim=True)
        x = x - x.mean(-1, keepdim=True)
    scale = (x.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt()  # [batch, 1], as the norm computes it
    attribution = torch.einsum("cbd,bd->cb", comps / scale * ln.gain, direction)  # [component, batch]
    labels, kinds, layers, heads = list(parts.labels), list(parts.kinds), list(parts.layers), list(parts.heads)
    if centred:
        attribution = torch.cat([attribution, (ln.bias * direction).sum(-1)[None]])
        labels.append("ln_final.bias"), kinds.append("ln_bias"), layers.append(None), heads.append(None)

    n_comp = attribution.shape[0]
    frame = pd.DataFrame({
        "batch": rows.repeat_interleave(n_comp).numpy(),
        "position": p.repeat_interleave(n_comp).cpu().numpy(),
        "component": labels * batch,
        "kind": kinds * batch,
        "layer": pd.array(layers * batch, dtype="Int64"),
        "head": pd.array(heads * batch, dtype="Int64"),
        "attribution": attribution.T.flatten().float().cpu().numpy(),
    })
    logits = model.readout_uncapped(final[rows, p])  # [batch, d_vocab], the model's own answer before any soft-cap
    target = logits.gather(-1, plus_ids[:, None])[:, 0]
    if minus_ids is not None:
        target = target - logits.gather(-1, minus_ids[:, None])[:, 0]
    frame.attrs["logit"] = target.float().cpu().tolist()
    return frame


# ------------------------------------------------------------------------ norms
def resid_norms(cache: ActivationCache, positions: slice | Sequence[int] | None = None) -> pd.DataFrame:
    """Norms of the stream after 0..n_layers blocks and of each block's two writes, per sequence.

    One row per (component, layer, batch), `component` in `resid`, `attn_out`, `mlp_out`; `layer` is the
    stream index for `resid` (0..n_layers) and the block index for the writes, whose output lands in
    stream `layer + 1`. Columns: `mean_norm` (L2 norm averaged over `positions`) and `rms` (root mean
    square entry over positions and d_model, i.e. sqrt(mean norm^2 / d_model)). `positions` defaults to
    all; `slice(1, None)` skips the first token, whose stream is often an outlier. Summarise across
    sequences with `lenses.metrics.mean_ci(frame, "rms", by=["component", "layer"], unit="batch")`.
    """
    sel = slice(None) if positions is None else positions
    entries = [("resid", l, stream_in(cache, Stream(l), "resid_norms")) for l in range(cache.n_layers + 1)]
    for i in range(cache.n_layers):
        entries.append(("attn_out", i, _need(cache, hook_name("attn_out", i), "resid_norms")))
        entries.append(("mlp_out", i, _need(cache, hook_name("mlp_out", i), "resid_norms")))
    device = entries[0][2].device  # each entry's numbers gather here (device to device), then cross to the host once
    norms, rms = [], []
    for _, _, x in entries:
        x = x[:, sel].float()  # [batch, pos, d_model]
        norms.append(x.norm(dim=-1).mean(-1).to(device))  # [batch]
        rms.append(x.pow(2).mean((-1, -2)).sqrt().to(device))
    norm_rows, rms_rows = torch.stack(norms).cpu().numpy(), torch.stack(rms).cpu().numpy()  # [entry, batch] each
    n_batch = norm_rows.shape[1]
    return pd.DataFrame({
        "component": np.repeat([component for component, _, _ in entries], n_batch),
        "layer": np.repeat([layer for _, layer, _ in entries], n_batch),
        "batch": np.tile(np.arange(n_batch), len(entries)),
        "mean_norm": norm_rows.reshape(-1),
        "rms": rms_rows.reshape(-1),
    })

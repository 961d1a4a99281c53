"""The feature lens: an SAE feature read through any lens at every stream after the one it writes to.

Two readings, which mean different things:

- `mode="direction"`: the feature's decoder direction W_dec[i] alone, a vector with no position and no norm of its
  own. Each lens is applied as the linear map it is on differences of streams: a basis lens's transform less its
  value at 0 (`(I + A_s) d` for the tuned lens, `J_s d` for a Jacobian lens, `d` for the logit lens), then the
  readout linearised: the final norm's centring (LayerNorm) and gain, then the unembedding, without the norm's
  scale, biases or any soft-cap. The result is the change in logits per unit of the feature, up to the norm's
  scale: which tokens the direction promotes and suppresses if it sat at stream s. Through the logit lens this
  is the same at every stream (the raw unembedding of the direction); the tuned and Jacobian lenses translate it
  into what stream s's readout would make of it, so their readings change with depth.
- `mode="stream"`: what the feature's write becomes. The model runs on `tokens` with and without alpha * W_dec[i]
  added at the SAE's hook; each lens decodes both runs' streams, and the reading is the mean difference of their
  logits over every token. It includes everything later blocks do with the write (attention moving it, MLPs
  reacting, norms rescaling), and works for any lens, a patchscope included.

>>> frame = feature_lens(model, Feature(sae, 168), {"logit": LogitLens(model), "tuned": tuned}, top_k=5)
>>> frame.query("lens == 'logit' and kind == 'promoted' and rank == 0")[["layer", "token"]]   # the top token per stream
    layer token
0       3     #
10      4     #
20      5     #
30      6     #
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd
import torch

from lenskit import HookedTransformer, Stream
from lenskit.observe.hooks import layer_of
from lenskit.pieces.norms import LayerNorm
from lenskit.saes.features import Feature, steering_hooks

from .base import BasisLens, Lens

MODES = ("direction", "stream")


def first_stream(model: HookedTransformer, hook: str) -> int:
    """The first stream (0..n_layers) that sees what is written at `hook`: resid_pre of block L is stream L itself;
    anything else inside block L (its sublayers' outputs, resid_mid, resid_post) reaches stream L + 1."""
    layer = layer_of(hook)
    if layer is None:
        raise ValueError(f"the feature lens reads SAEs inside the blocks; {hook!r} is not in a block")
    return layer if hook == Stream(layer).hook_name(model.cfg.n_layers) else layer + 1


def linear_readout(model: HookedTransformer, v: torch.Tensor) -> torch.Tensor:
    """The readout's linear part on a direction v [..., d_model]: centring (LayerNorm), gain, unembedding, the logits'
    scale (Granite's)."""
    ln = model.ln_final
    v = v.to(model.unembed.weight.dtype)
    if isinstance(ln, LayerNorm):  # it centres; RMSNorm does not
        v = v - v.mean(-1, keepdim=True)
    return model.readout.scaled((v * ln.gain) @ model.unembed.weight.T).float()


@torch.no_grad()
def direction_logits(model: HookedTransformer, lens: Lens, v: torch.Tensor, s: Stream) -> torch.Tensor:
    """A basis lens's reading of direction v [d_model] at stream s: logits [d_vocab] (see the module docstring)."""
    if not isinstance(lens, BasisLens):
        raise ValueError(f"{type(lens).__name__} is not a basis lens, so it has no linear map to apply to a direction; "
                         "read it with mode='stream'")
    both = torch.stack([v, torch.zeros_like(v)])[:, None].to(model.unembed.weight.dtype)  # [2, 1, d_model]
    moved = lens.transform_hidden(both, s)
    return linear_readout(model, moved[0, 0] - moved[1, 0])


@torch.no_grad()
def stream_logits(model: HookedTransformer, lens: Lens, feature: Feature, tokens: torch.Tensor, streams: list[Stream],
                  alpha: float) -> dict[int, torch.Tensor]:
    """Mean over tokens of lens(stream with the feature's write added) - lens(stream without): {layer: [d_vocab]}."""
    names = [s.hook_name(model.cfg.n_layers) for s in streams]
    _, clean = model.run_with_cache(tokens, names_filter=names)
    _, steered = model.run_with_cache(tokens, names_filter=names, fwd_hooks=steering_hooks(feature, alpha))
    return {s.layer: (lens(steered[n], s) - lens(clean[n], s)).float().mean((0, 1)) for s, n in zip(streams, names)}


def feature_lens(model: HookedTransformer, feature: Feature, lenses: Mapping[str, Lens], *, mode: str = "direction",
                 tokens: torch.Tensor | None = None, alpha: float = 1.0, top_k: int = 10) -> pd.DataFrame:
    """Promoted and suppressed tokens of `feature` (its first latent) through each lens at every stream from the
    one its SAE writes to: one row per (lens, layer, kind, rank) with token, token_id and logit (the reading's
    value; in "direction" mode per unit activation, in "stream" mode a mean logit difference)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "stream" and tokens is None:
        raise ValueError("mode='stream' runs the model: pass tokens=[batch, pos]")
    sae = feature.sae
    start = first_stream(model, sae.hook_name_out)
    if sae.cfg.out_width != model.cfg.d_model:
        raise ValueError(f"{feature!r} writes vectors of width {sae.cfg.out_width}, not the stream's d_model "
                         f"{model.cfg.d_model}; the feature lens reads SAEs that write to the residual stream")
    streams = [Stream(l) for l in range(start, model.cfg.n_layers + 1)]
    v = sae.W_dec[feature.index[0]].to(model.unembed.weight.device)
    rows = []
    for name, lens in lenses.items():
        if mode == "direction":
            readings = {s.layer: direction_logits(model, lens, v, s) for s in streams if lens.covers(s)}
        else:
            single = Feature(sae, feature.index[0])
            readings = stream_logits(model, lens, single, tokens, [s for s in streams if lens.covers(s)], alpha)
        if not readings:
            continue
        stacked = torch.stack(list(readings.values()))  # [layer, d_vocab]
        # [layer, k] each, read back once per lens and kind rather than once per stream
        tops = {kind: [t.tolist() for t in stacked.topk(top_k, dim=-1, largest=largest)]
                for kind, largest in (("promoted", True), ("suppressed", False))}
        for i, layer in enumerate(readings):
            for kind, (vals, ids) in tops.items():
                for rank, (val, tid) in enumerate(zip(vals[i], ids[i])):
                    token = model.to_string(torch.tensor([tid])) if model.tokenizer is not None else str(tid)
                    rows.append({"lens": name, "layer": layer, "kind": kind, "rank": rank, "token": token,
                                 "token_id": tid, "logit": val})
    frame = pd.DataFrame(rows, columns=["lens", "layer", "kind", "rank", "token", "token_id", "logit"])
    frame.attrs.update(feature=feature.index[0], hook=sae.hook_name_out, mode=mode)
    return frame

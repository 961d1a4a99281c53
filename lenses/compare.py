"""The lens under intervention: read the clean run and an edited run (an ablation, a patch) through the same
lens, layer by layer, and see where and how the edit changes what the model is about to say.

>>> from lenskit.intervene.interventions import Head, ablation_hooks
>>> frame = compare_runs(model, "def add(a, b):\\n    return a + b", ablation_hooks(model, Head(2, 1)))
>>> frame.query("layer == 6")[["position", "clean_top_token", "ablated_top_token"]].head(3)
    position clean_top_token ablated_top_token
72         0            test              test
73         1               _                 _
74         2            self              self
>>> bool((frame["kl"] >= 0).all())                          # KL(clean || ablated) per layer and position
True
>>> fig = plots.difference_heatmap(frame, "delta_target_prob")     # or "kl"

Both runs decode every stream 0..n_layers with one lens (the logit lens unless you pass another). Per
(layer, position) the frame holds each run's top-1 token and probability, each run's probability and
loss (-log p, nats) for a target token, their change, and KL(clean || ablated) in nats: the extra nats
the ablated lens pays on tokens drawn from the clean lens's distribution. At layer n_layers this is the
KL between the two models' outputs, and with the default target (the next input token) the losses are
the language-modelling losses of the two runs.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from lenskit import HookedTransformer
from lenskit.io.text import token_texts
from lenskit.observe.hooks import HookFn, NameOrPredicate
from lenskit.observe.stream import streams

from . import metrics
from .base import Lens
from .logit import LogitLens
from .trajectory import NO_TARGET, targets_for, tokens_and_lengths

COLUMNS = [
    "layer", "position", "input_token", "input_token_id", "target_token", "target_token_id",
    "clean_top_token", "clean_top_token_id", "clean_top_prob",
    "ablated_top_token", "ablated_top_token_id", "ablated_top_prob",
    "clean_target_prob", "ablated_target_prob", "delta_target_prob",
    "clean_target_loss", "ablated_target_loss", "delta_target_loss", "kl",
]


@torch.no_grad()
def compare_runs(
    model: HookedTransformer,
    prompt: str | Sequence[str] | torch.Tensor,
    fwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]],
    *,
    lens: Lens | None = None,
    target: int | str | torch.Tensor | None = None,
) -> pd.DataFrame:
    """One row per (layer, position) [and batch, when there are several sequences]: the clean run beside
    the run with `fwd_hooks` attached, both read through `lens` at every stream 0..n_layers.

    target: None = the next input token (no target at a sequence's last position), an id or one-token
    text = that token everywhere, or ids [batch, pos] with -1 for none (as in `Trajectory.from_prompt`).
    Columns: see `COLUMNS`; probabilities in [0, 1], losses and `kl` (KL(clean || ablated)) in nats,
    `delta_*` = ablated - clean. Rows without a target have NaN target columns; padding is left out.
    The hooks act during the forward pass only, so edits at or after the final norm do not reach the lens.
    """
    lens = LogitLens(model) if lens is None else lens
    if lens.model is not model:
        raise ValueError("the lens was built for a different model object; build it with this model, e.g. LogitLens(model)")
    tokens, lengths = tokens_and_lengths(model, prompt)
    targets = targets_for(model, target, tokens, lengths)  # [batch, pos], NO_TARGET where none
    names = [s.hook_name(model.cfg.n_layers) for s in streams(model.cfg.n_layers)]
    # Streams only: the lens decodes each of them, the last included, one layer at a time below.
    _, clean = model.run_with_cache(tokens, names_filter=names, return_logits=False)
    _, ablated = model.run_with_cache(tokens, names_filter=names, fwd_hooks=list(fwd_hooks), return_logits=False)

    has_target = targets != NO_TARGET
    safe = targets.clamp(min=0).to(tokens.device).unsqueeze(-1)  # [batch, pos, 1]
    per_layer = []
    for layer, name in enumerate(names):  # one layer's logits per run alive at a time
        logp_c = metrics.log_probs(lens(clean[name], layer))  # [batch, pos, d_vocab]
        logp_a = metrics.log_probs(lens(ablated[name], layer))
        top_c, top_a = logp_c.max(-1), logp_a.max(-1)
        per_layer.append({
            "clean_top_token_id": top_c.indices, "clean_top_prob": top_c.values.exp(),
            "ablated_top_token_id": top_a.indices, "ablated_top_prob": top_a.values.exp(),
            "clean_target_loss": -logp_c.gather(-1, safe).squeeze(-1),
            "ablated_target_loss": -logp_a.gather(-1, safe).squeeze(-1),
            "kl": metrics.kl_divergence(logp_c, logp_a),
        })
        del logp_c, logp_a
    stacked = {k: torch.stack([d[k] for d in per_layer]).cpu() for k in per_layer[0]}  # each [layer, batch, pos]
    return _to_frame(model, tokens.cpu(), lengths, targets, has_target, stacked)


def _to_frame(model: HookedTransformer, tokens: torch.Tensor, lengths: torch.Tensor, targets: torch.Tensor,
              has_target: torch.Tensor, stacked: dict[str, torch.Tensor]) -> pd.DataFrame:
    L, B, P = stacked["kl"].shape
    layer, b, pos = np.meshgrid(np.arange(L), np.arange(B), np.arange(P), indexing="ij")
    keep = (pos < lengths.numpy()[b]).ravel()  # drop padding
    layer, b, pos = layer.ravel()[keep], b.ravel()[keep], pos.ravel()[keep]
    flat = {k: v.reshape(-1).numpy()[keep] for k, v in stacked.items()}
    tgt = targets.numpy()[b, pos]
    no_tgt = ~has_target.numpy()[b, pos]
    decode = lambda ids: token_texts(model.tokenizer, ids)  # noqa: E731 - as Trajectory shows them
    cols: dict[str, object] = {"batch": b} if B > 1 else {}
    cols |= {"layer": layer, "position": pos, "input_token": decode(tokens.numpy()[b, pos]),
             "input_token_id": tokens.numpy()[b, pos]}
    cols["target_token"] = [None if none else t for t, none in zip(decode(np.maximum(tgt, 0)), no_tgt)]
    cols["target_token_id"] = tgt
    for run in ("clean", "ablated"):
        cols[f"{run}_top_token"] = decode(flat[f"{run}_top_token_id"])
        cols[f"{run}_top_token_id"] = flat[f"{run}_top_token_id"]
        cols[f"{run}_top_prob"] = flat[f"{run}_top_prob"]
    for run in ("clean", "ablated"):
        cols[f"{run}_target_prob"] = np.where(no_tgt, np.nan, np.exp(-flat[f"{run}_target_loss"]))
    cols["delta_target_prob"] = cols["ablated_target_prob"] - cols["clean_target_prob"]
    for run in ("clean", "ablated"):
        cols[f"{run}_target_loss"] = np.where(no_tgt, np.nan, flat[f"{run}_target_loss"])
    cols["delta_target_loss"] = cols["ablated_target_loss"] - cols["clean_target_loss"]
    cols["kl"] = flat["kl"]
    return pd.DataFrame(cols)


def output_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """The last layer's rows (the models' own outputs) at positions that have a target, renamed for a
    per-position report: position, input_token, target_token, clean/ablated top token (and id),
    clean_loss, ablated_loss, delta_loss and kl (KL(clean || ablated), nats)."""
    last = frame[(frame["layer"] == frame["layer"].max()) & frame["clean_target_loss"].notna()]
    keep = ["batch"] if "batch" in frame.columns else []
    keep += ["position", "input_token", "target_token", "clean_top_token", "clean_top_token_id",
             "ablated_top_token", "ablated_top_token_id", "clean_target_loss", "ablated_target_loss",
             "delta_target_loss", "kl"]
    out = last[keep].rename(columns={"clean_target_loss": "clean_loss", "ablated_target_loss": "ablated_loss",
                                     "delta_target_loss": "delta_loss"})
    return out.reset_index(drop=True)

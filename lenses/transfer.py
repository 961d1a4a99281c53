"""Layer transfer (Belrose et al. 2023, the transfer-penalty figure): how well the translator trained for one
stream reads the others.

    M[i, j] = mean over tokens of KL(final || readout(translator_i(h_j)))

for translators i and streams j in 0..n_layers-1 (stream j: the residual stream after j blocks), with the
tuned lens's `resid_pre` translators. The diagonal M[j, j] is the lens's own KL at stream j, and
`transfer_penalty(M)[i, j] = M[i, j] - M[j, j]` is what reading stream j with translator i costs over the
translator trained for it: the paper's figure.

It runs through `lenses.evaluation.evaluate_windows`, each translator wrapped as a lens of its own, so it
takes evaluation's path: the same KL, a chunk of tokens at a time in reused buffers (memory bounded whatever
the depth), and the diagonal is exactly the evaluation's per-layer KL on the same windows.

>>> from lenses.evaluation import heldout_windows
>>> M = layer_transfer(model, tuned, heldout_windows(stream, 2**9, 256, model.cfg.n_ctx), progress=False)
>>> M.shape                                  # [translator, stream]
(6, 6)
>>> fig = plots.transfer_heatmap(transfer_penalty(M))
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from lenskit import HookedTransformer, Stream

from .base import BasisLens
from .evaluation import evaluate_windows
from .tuned import TunedLens


class _Transplanted(BasisLens):
    """Translator `source` of a tuned lens applied to whichever stream it is handed, read out by the model."""

    def __init__(self, tuned: TunedLens, source: int) -> None:
        super().__init__(tuned.model)
        object.__setattr__(self, "tuned", tuned)  # not a submodule: this view owns no weights
        self.source = Stream(source)

    def transform_hidden(self, h: torch.Tensor, s: Stream) -> torch.Tensor:
        return self.tuned.transform_hidden(h, self.source)

    def covers(self, s: Stream) -> bool:
        # The streams that have translators; the last one (the model's output) is left out of the matrix.
        return s.point == "resid_pre" and s.layer < self.n_layers


def check_tuned(lens: object, what: str = "layer transfer") -> TunedLens:
    """`lens` if it is a TunedLens, else a one-line ValueError saying what is needed."""
    if not isinstance(lens, TunedLens):
        kind = getattr(lens, "name", type(lens).__name__)
        raise ValueError(f"{what} applies a tuned lens's per-stream translators to other streams, and a {kind} lens "
                         "has none; pass a TunedLens (a folder written by `lenskit train-lens`)")
    return lens


def layer_transfer(model: HookedTransformer, tuned: TunedLens, windows: torch.Tensor, batch: int = 8,
                   progress: bool = True) -> pd.DataFrame:
    """windows [n_windows, ctx] -> the transfer matrix as a DataFrame [translator, stream], both 0..n_layers-1:
    entry (i, j) is the mean over every token of the windows of KL(final || readout(translator_i(h_j))), nats.

    `.attrs` holds n_tokens and n_windows. Every entry is measured on the same tokens, a batch of windows
    at a time (`evaluate_windows`), with n_layers^2 readouts per token.
    """
    check_tuned(tuned)
    if tuned.model is not model:
        raise ValueError("the tuned lens was built for another model object; load it onto the model being measured")
    n = model.cfg.n_layers
    views = {i: _Transplanted(tuned, i) for i in range(n)}
    tidy = evaluate_windows(model, views, windows, batch=batch, progress=progress)
    tidy = tidy[tidy["layer"] < n]
    # Windows are equally long, so the mean of the per-window means is the mean over tokens (as per_layer takes it).
    matrix = tidy.groupby(["lens", "layer"])["kl"].mean().unstack("layer").sort_index().sort_index(axis=1)
    matrix.index.name, matrix.columns.name = "translator", "stream"
    matrix.attrs.update(n_tokens=int(windows.numel()), n_windows=int(windows.shape[0]))
    return matrix


def transfer_penalty(matrix: pd.DataFrame) -> pd.DataFrame:
    """M[i, j] - M[j, j]: the extra KL, nats, of reading stream j with translator i instead of its own (0 on the diagonal)."""
    if matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"a transfer matrix is square [translator, stream]; got shape {matrix.shape}")
    out = matrix - np.diag(matrix.to_numpy())[None, :]
    out.attrs = dict(matrix.attrs)
    return out


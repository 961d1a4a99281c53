"""The Jacobian lens (Gurnee et al., "Verbalizable Representations Form a Global Workspace in Language Models",
Transformer Circuits, 2026): one d_model x d_model matrix J_s per stream, the averaged Jacobian of the last
block's output (before the final norm) with respect to stream s,

    J_s = E_prompt[ (1/|V|) sum_{t in V} sum_{t' in V, t' >= t} d h_final,t' / d h_s,t ]

over the valid positions V = [skip_first_positions, T - 1) of each prompt. It reads `readout(J_s h)`; the logit
lens is J = I. The rows of W_U J_s ("lens vectors") are directions in stream s that the model reads as single
tokens; the intervention hooks steer along them, project them out, or swap two of them.

>>> jlens = JacobianLens.fit(model, windows[:2, :32], progress=False)   # tokens [n, pos]: every stream 0..n_layers-1
>>> jlens(cache.stream(2), 2).shape                      # logits [batch, pos, d_vocab]
torch.Size([1, 13, 4096])
>>> steered = model.run_with_hooks(tokens, fwd_hooks=jlens.steering_hooks(3, " self", alpha=8.0))
>>> folder = jlens.save("my_jlens");  again = JacobianLens.load(folder, model)
>>> torch.equal(again(cache.stream(2), 2), jlens(cache.stream(2), 2))
True

A reference `.pt` from the hub loads the same way:
`JacobianLens.load("someone/jacobian-lens", model, filename="gpt2/lens.pt")`.

Stream s is the stream after s blocks, so the reference's (and TransformerLens's) layer l, the output of block l,
is our stream l + 1; our stream 0 (the embeddings) has no place in the reference file format.
Files, reference import/export and checks live in `lenses.jacobian_io`, fitting in `lenses.jacobian_fit`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

import torch

from lenskit import HookedTransformer, Stream

from .base import BasisLens
from .card import JACOBIAN_FORMAT as FORMAT  # noqa: F401 - lenses.jacobian.FORMAT, read by lenses.spec
from .jacobian_fit import CHECKPOINT_EVERY, DIM_BATCH, SKIP_FIRST_POSITIONS, fit  # noqa: F401 - re-exported
from .jacobian_io import FORMAT_VERSION, WEIGHTS_FILE, folder_config, load, save_folder, save_reference  # noqa: F401
from .tuned import model_fingerprint

TokenLike = Union[int, str]
HookList = list[tuple[str, Callable[[torch.Tensor, Any], torch.Tensor]]]


class JacobianLens(BasisLens):
    """`jlens(h, s)` = `readout(J_s h)` for each fitted stream s; stream n_layers is the identity (the model's output).

    `matrices` maps a stream index (0..n_layers-1) to J_s [d_model, d_model]; the matrices stay float64 if
    given so, else are held in float32, on the model's device. `info` is what `save` writes beside them
    (estimator settings, data provenance).
    """

    name = "jacobian"

    def __init__(self, model: HookedTransformer, matrices: Mapping[int, torch.Tensor], info: dict | None = None) -> None:
        super().__init__(model)
        n, d = model.cfg.n_layers, model.cfg.d_model
        if not matrices:
            raise ValueError("a Jacobian lens needs at least one matrix; pass {stream: J_s} or fit one with JacobianLens.fit")
        device = model.unembed.weight.device
        self._streams: list[int] = []
        for s in sorted(matrices):
            J = matrices[s]
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < n:
                raise ValueError(f"Jacobian lens matrices are keyed by stream 0..{n - 1} (stream {n} is the identity), "
                                 f"got key {s!r}")
            if not isinstance(J, torch.Tensor) or J.shape != (d, d) or not J.dtype.is_floating_point:
                got = f"{tuple(J.shape)} {J.dtype}" if isinstance(J, torch.Tensor) else type(J).__name__
                raise ValueError(f"J for stream {s} must be a floating [{d}, {d}] tensor (d_model={d}), got {got}")
            dtype = torch.float64 if J.dtype == torch.float64 else torch.float32
            self.register_buffer(f"J_{s}", J.detach().to(device=device, dtype=dtype).contiguous())
            self._streams.append(s)
        self.fingerprint = model_fingerprint(model)
        self.info: dict[str, Any] = dict(info or {})

    @classmethod
    def fit(cls, model: HookedTransformer, tokens: torch.Tensor | Sequence[torch.Tensor], *,
            skip_first_positions: int = SKIP_FIRST_POSITIONS, streams: Sequence[int | str | Stream] | None = None,
            exclude_last: bool = True, dim_batch: int | None = None, progress: bool = True, out: str | os.PathLike | None = None,
            provenance: dict | None = None, checkpoint_every: int = CHECKPOINT_EVERY,
            checkpoint_minutes: float = 5.0) -> "JacobianLens":
        """Fit J_s on `tokens`: [n, pos] ids, or a list of 1-D id tensors (one prompt each, any lengths).

        `streams`: which to fit (None: every stream 0..n_layers-1; stream n_layers is the identity). Valid positions
        are [skip_first_positions, T - 1), or [skip_first_positions, T) with exclude_last=False; shorter prompts are
        skipped with a warning. `dim_batch`: output dimensions per backward pass (speed only; None: the device's,
        `lenses.jacobian_fit.dim_batch_for`). `out`: a folder to checkpoint in (every `checkpoint_every` prompts, at
        most `checkpoint_minutes` apart, and on a stop signal), resume from, and save the lens to. `provenance`: plain values
        saying where the tokens came from, saved as the lens's "data". See `lenses.jacobian_fit`.
        """
        return fit(cls, model, tokens, skip_first_positions=skip_first_positions, streams=streams, exclude_last=exclude_last,
                   dim_batch=dim_batch, progress=progress, out=out, provenance=provenance, checkpoint_every=checkpoint_every,
                   checkpoint_minutes=checkpoint_minutes)

    # ----------------------------------------------------------------- reading
    @property
    def streams(self) -> list[int]:
        """The fitted streams, in depth order (stream n_layers, the identity, is not listed)."""
        return list(self._streams)

    def _fitted(self, s: int | str | Stream) -> int | None:
        """The stream index of s (resolved, resid_post read as the next resid_pre): None at n_layers, where J = I.
        Raises a one-line ValueError at a stream this lens has no matrix for."""
        s = self.stream(s).canonical()
        if s.point == "resid_pre" and s.layer == self.n_layers:
            return None
        if s.point != "resid_pre" or s.layer not in self._streams:
            raise ValueError(f"this Jacobian lens has no matrix for {s}: it covers streams {self._streams} (and "
                             f"{self.n_layers}, the identity); read one of those, or fit it with streams=[...] that include it")
        return s.layer

    def covers(self, s: Stream) -> bool:
        s = s.canonical()
        return s.point == "resid_pre" and (s.layer == self.n_layers or s.layer in self._streams)

    def reads_as_model(self, s: Stream) -> bool:
        s = s.canonical()
        return s.point == "resid_pre" and s.layer == self.n_layers

    def matrix(self, s: int | str | Stream) -> torch.Tensor:
        """J_s [d_model, d_model] (the identity at stream n_layers)."""
        layer = self._fitted(s)
        if layer is None:
            J = getattr(self, f"J_{self._streams[0]}")
            return torch.eye(self.model.cfg.d_model, dtype=J.dtype, device=J.device)
        return getattr(self, f"J_{layer}")

    def transform_hidden(self, h: torch.Tensor, s: Stream) -> torch.Tensor:
        """[..., d_model] -> [..., d_model]: h @ J_s.T, in the matrices' dtype and cast back to h's (h itself at n_layers)."""
        layer = self._fitted(s)
        if layer is None:
            return h
        J = getattr(self, f"J_{layer}")
        h = h.to(J.device)  # under a device map, a stream read on its block's device is read where the lens lives
        if J.dtype == h.dtype:
            return h @ J.T
        return (h.to(J.dtype) @ J.T).to(h.dtype)  # a float32 lens on a lower-precision model

    def extra_repr(self) -> str:
        estimator = self.info.get("estimator") if isinstance(self.info.get("estimator"), dict) else {}
        return f"streams={self._streams}, d_model={self.model.cfg.d_model}, n_prompts={estimator.get('n_prompts')}"

    # ------------------------------------------------------------ lens vectors
    def token_ids(self, tokens: TokenLike | Sequence[TokenLike] | torch.Tensor) -> list[int]:
        """Token ids from an id, a one-token string (through the model's tokenizer), or a sequence of them."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        items = [tokens] if isinstance(tokens, (int, str)) else list(tokens)
        if not items:
            raise ValueError("no tokens given; pass a token id, a one-token string, or a list of them")
        ids = [self.model.to_single_token(t) if isinstance(t, str) else t for t in items]
        vocab = self.model.cfg.d_vocab
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"token {t!r} is not an id in the vocabulary [0, {vocab}); pass ids or one-token strings")
        return ids

    def lens_vectors(self, s: int | str | Stream, tokens: TokenLike | Sequence[TokenLike] | torch.Tensor) -> torch.Tensor:
        """[k, d_model]: the rows of W_U J_s for the k tokens (W_U = the unembedding, [d_vocab, d_model]), in the
        matrices' dtype. The direction in stream s whose growth raises each token's logit through J_s."""
        J = self.matrix(s)
        W_U = self.model.unembed.weight.detach()
        with torch.no_grad():
            rows = self.model.readout.scaled(W_U[self.token_ids(tokens)])  # the logits' scale too, where there is one
            return rows.to(device=J.device, dtype=J.dtype) @ J  # [k, d_model]

    # ----------------------------------------------------------- interventions
    def steering_hooks(self, s: int | str | Stream, token: TokenLike, alpha: float,
                       positions: Sequence[int] | None = None) -> HookList:
        """`h <- h + alpha * v / |v|` at stream s, v the token's lens vector (TransformerLens instead scales alpha by
        the median norm of h; pass alpha * that for its convention). For `model.run_with_hooks(..., fwd_hooks=...)`."""
        unit = unit_rows(self.lens_vectors(s, token), s)[0]  # [d_model]
        return [(self._hook_name(s), edit_hook(lambda x: x + alpha * unit, positions, unit.dtype))]

    def ablation_hooks(self, s: int | str | Stream, tokens: TokenLike | Sequence[TokenLike] | torch.Tensor,
                       positions: Sequence[int] | None = None) -> HookList:
        """Project the span of the tokens' lens vectors out of stream s: `h <- h - Q Q^T h`, Q an orthonormal basis
        of the span (so h ends orthogonal to every vector, even where the vectors are far from orthogonal)."""
        V = unit_rows(self.lens_vectors(s, tokens), s)  # [k, d_model]
        U, sv, _ = torch.linalg.svd(V.T, full_matrices=False)  # U [d_model, k]
        Q = U[:, sv > sv[0] * V.shape[-1] * torch.finfo(V.dtype).eps]  # [d_model, rank]: dependent vectors add nothing
        return [(self._hook_name(s), edit_hook(lambda x: x - (x @ Q) @ Q.T, positions, Q.dtype))]

    def swap_hooks(self, s: int | str | Stream, source_token: TokenLike, target_token: TokenLike,
                   positions: Sequence[int] | None = None, alpha: float = 1.0) -> HookList:
        """Exchange two tokens' coordinates in stream s: with V = [v_source, v_target] and c = V^+ h (pseudo-inverse),
        `h <- h + alpha V (swap(c) - c)`, so the source concept's coordinate moves onto the target and back; the
        part of h orthogonal to span{v_source, v_target} is untouched. alpha = 2 is the paper's double-strength swap."""
        ids = self.token_ids([source_token, target_token])
        if ids[0] == ids[1]:
            raise ValueError(f"source and target are the same token (id {ids[0]}); a swap would change nothing: pass two tokens")
        V = self.lens_vectors(s, ids).T  # [d_model, 2]
        unit_rows(V.T, s)
        pinv = torch.linalg.pinv(V)  # [2, d_model]

        def swap(x: torch.Tensor) -> torch.Tensor:
            c = x @ pinv.T  # [..., 2]
            return x + alpha * ((c.flip(-1) - c) @ V.T)

        return [(self._hook_name(s), edit_hook(swap, positions, V.dtype))]

    def _hook_name(self, s: int | str | Stream) -> str:
        layer = self._fitted(s)
        return Stream(self.n_layers if layer is None else layer).hook_name(self.n_layers)

    # ------------------------------------------------------------------- files
    def save(self, folder: str | os.PathLike) -> Path:
        """Write `lens.safetensors` (J.{stream}), `config.json` and a `README.md` card into folder, each atomically."""
        return save_folder(self, folder)

    def save_reference(self, path: str | os.PathLike, dtype: torch.dtype = torch.float16) -> Path:
        """Write the reference implementation's `.pt` dict (J keyed by layer = stream - 1; stream 0 is left out)."""
        return save_reference(self, path, dtype)

    @classmethod
    def load(cls, source: str | os.PathLike, model: HookedTransformer, filename: str | None = None) -> "JacobianLens":
        """A lens folder (written by `save`), a reference `.pt` file, or a hub repo id (with `filename`, the `.pt`
        inside it; without, a lens folder repo), from the local Hugging Face cache first. Refused, in one line,
        when the lens belongs to another model."""
        return load(cls, source, model, filename)

    def config(self) -> dict[str, Any]:
        return folder_config(self)


def unit_rows(vectors: torch.Tensor, s: int | str | Stream) -> torch.Tensor:
    """Each row over its norm; a zero or non-finite lens vector (nothing to steer along) is a one-line ValueError."""
    norms = vectors.norm(dim=-1, keepdim=True)
    if not bool(torch.isfinite(norms).all()) or bool((norms <= torch.finfo(vectors.dtype).tiny).any()):
        raise ValueError(f"a lens vector at stream {s} is zero or not finite, so it has no direction; pick other tokens")
    return vectors / norms


def edit_hook(transform: Callable[[torch.Tensor], torch.Tensor], positions: Sequence[int] | None,
              dtype: torch.dtype) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """A hook that replaces the stream x [batch, pos, d_model] by `transform(x)` (computed in `dtype`, cast back to
    x's), at every position or at `positions` only (negative positions count from the end of each run)."""
    wanted = None if positions is None else [int(p) for p in positions]
    if wanted is not None and not wanted:
        raise ValueError("positions is empty; pass None for every position, or at least one index")

    def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
        if wanted is None:
            return transform(x.to(dtype)).to(x.dtype)
        n_pos = x.shape[1]
        bad = [p for p in wanted if not -n_pos <= p < n_pos]
        if bad:
            raise ValueError(f"positions {bad} are out of range for a run of {n_pos} positions at {hook.name}")
        at = [p % n_pos for p in wanted]
        out = x.clone()
        out[:, at] = transform(x[:, at].to(dtype)).to(x.dtype)
        return out

    return hook

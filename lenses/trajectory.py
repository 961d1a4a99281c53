"""Trajectory: what a lens reads at every stream 0..n_layers for every position of a prompt, as small tensors.

A trajectory keeps summaries, never distributions: for each (layer, batch, pos) the top-k tokens and
probabilities, the entropy, KL(final || lens), and the rank and probability of a target token. It is
computed one layer at a time on chunks of positions, so it never holds `(n_layers + 1) x pos x d_vocab`
logits, nor even one layer's full logits when the prompt is long.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm  # tqdm.auto warns "IProgress not found" in kernels without ipywidgets

from lenskit import HookedTransformer
from lenskit.io.text import encode_texts, is_text, single_token_id, token_texts
from lenskit.observe.stream import streams

from .base import Lens
from .chunks import chunk_rows, cross_term, shifted_stats

NO_TARGET = -1
NO_TOKEN = -1  # top_ids at a stream the lens does not cover (`Lens.covers`): its numbers there are NaN


@dataclass
class Trajectory:
    """Per-layer summaries of a lens's predictions. Axes: layer = stream 0..n_layers (after that many blocks).

    tokens       [batch, pos]                 input ids
    lengths      [batch]                      real (unpadded) length of each sequence
    top_ids      [layer, batch, pos, k]       the lens's k most likely next tokens (NO_TOKEN, -1, and NaN numbers
                                              at a stream the lens does not cover)
    top_probs    [layer, batch, pos, k]
    entropy      [layer, batch, pos]          H(lens), nats
    kl_to_final  [layer, batch, pos]          KL(final || lens), nats: 0 at layer n_layers
    targets      [batch, pos]                 target id per position, NO_TARGET (-1) where none
    target_rank  [layer, batch, pos]          0 = the lens's top-1; -1 where there is no target
    target_logprob [layer, batch, pos]        log-probability of the target (nats); nan where there is no target
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    entropy: torch.Tensor
    kl_to_final: torch.Tensor
    targets: torch.Tensor
    target_rank: torch.Tensor
    target_logprob: torch.Tensor
    lens_name: str = "lens"
    tokenizer: object | None = field(default=None, repr=False)

    @property
    def n_layers(self) -> int:
        return self.entropy.shape[0] - 1

    @property
    def top_k(self) -> int:
        return self.top_ids.shape[-1]

    def __repr__(self) -> str:
        """One line: lens, prompt length(s), layers, top-k (the tensors are in the fields and `to_frame()`)."""
        lengths = self.lengths.tolist()
        prompt = (f"{lengths[0]} tokens" if len(lengths) == 1
                  else f"{len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens")
        return f"Trajectory({self.lens_name} lens, {prompt}, layers 0..{self.n_layers}, top-{self.top_k})"

    @property
    def target_prob(self) -> torch.Tensor:
        """[layer, batch, pos] probability of the target; nan where there is no target."""
        return self.target_logprob.exp()

    # ------------------------------------------------------------ building
    @classmethod
    @torch.no_grad()
    def from_prompt(
        cls,
        lens: Lens,
        prompt_or_tokens: str | Sequence[str] | torch.Tensor,
        top_k: int = 5,
        target: int | str | torch.Tensor | None = None,
        chunk_size: int | None = None,
        progress: bool = False,
    ) -> "Trajectory":
        """Run `prompt_or_tokens` once through the lens's model and read every stream 0..n_layers through `lens`.

        `lens` is any `lenses.Lens` (`LogitLens(model)`, a `TunedLens`, ...); it knows its model. `target` picks the token
        whose rank and probability are tracked: None = the next input token (none at a sequence's last
        position), an int id or a one-token string = that token everywhere, or ids [batch, pos]
        (or [pos]) with -1 for "no target". `chunk_size` = (batch, position) rows decoded at once (default: the
        device's rule, `lenses.chunks.chunk_rows`); lower it to save memory. Results stay on the lens's device
        until the end, and are copied to the host once.

        >>> traj = Trajectory.from_prompt(LogitLens(model), "def add(a, b):\\n    return", top_k=5)
        >>> traj.to_frame().query("layer == 6")[["position", "input_token", "top_token", "top_prob"]]  # doctest: +ELLIPSIS
            position input_token top_token  top_prob
        ...
        """
        model = lens.model
        if not isinstance(top_k, int) or not 1 <= top_k <= model.cfg.d_vocab:
            raise ValueError(f"top_k must be an int in 1..d_vocab={model.cfg.d_vocab}, got {top_k!r}")
        tokens, lengths = tokens_and_lengths(model, prompt_or_tokens)
        targets = targets_for(model, target, tokens, lengths)
        n_layers = model.cfg.n_layers
        names = [s.hook_name(n_layers) for s in streams(n_layers)]
        # The streams are small (layer x pos x d_model); the final logits are recomputed per chunk below
        # from the last stream instead of being taken from the forward, which would materialise them whole.
        _, cache = model.run_with_cache(tokens, names_filter=names, stop_at_layer=n_layers)
        batch, pos = tokens.shape
        rows = batch * pos  # decode (batch, pos) rows in flat chunks
        flat_streams = [cache[n].reshape(rows, -1) for n in names]  # each [batch*pos, d_model]
        readout = model.readout
        device, d_vocab = readout.weight.device, readout.d_vocab  # where the lens reads out (device maps)
        flat_targets = targets.reshape(rows).to(device)
        safe_targets = flat_targets.clamp(min=0)[:, None]  # [rows, 1]
        chunk = min(rows, chunk_size or chunk_rows(readout, buffers=4))
        dtype = torch.float64 if readout.weight.dtype == torch.float64 else torch.float32
        z, e, f_e, scratch = torch.empty(4, chunk, d_vocab, dtype=dtype, device=device)  # reused by every chunk

        L = n_layers + 1
        locations = streams(n_layers)
        covered = [lens.covers(s) for s in locations]
        # The last stream read as the model reads it is the final itself: its numbers are the final's, KL 0.
        last_is_final = covered[-1] and lens.reads_as_model(locations[-1])
        # Per-row statistics stay on the device, NaN where the lens does not decode, and are finished after the
        # loops (see `shifted_stats`): the top-k logits and ids, the target's logit and rank, log sum e,
        # sum e (z - peak), sum e and the cross term with the final.
        top_z = torch.full((L, rows, top_k), torch.nan, dtype=dtype, device=device)
        top_ids = torch.full((L, rows, top_k), NO_TOKEN, dtype=torch.long, device=device)
        target_z, log_mass, weighted, mass, cross = torch.full((5, L, rows), torch.nan, dtype=dtype, device=device)
        rank = torch.full((L, rows), NO_TARGET, dtype=torch.long, device=device)
        f_log_mass, f_weighted, f_mass = torch.empty(3, rows, dtype=dtype, device=device)
        desc = f"trajectory ({getattr(lens, 'name', 'lens')} lens)"
        for start in tqdm(range(0, rows, chunk), desc=desc, disable=not progress):
            sl = slice(start, start + chunk)
            c, tgt = min(chunk, rows - start), safe_targets[sl]
            zf = readout.into(flat_streams[n_layers][sl], z[:c])  # the model's own final logits
            peak = (_top_and_target(zf, tgt, top_z[n_layers, sl], top_ids[n_layers, sl], target_z[n_layers, sl],
                                    rank[n_layers, sl], scratch[:c]) if last_is_final else None)
            _, f_log_mass[sl], f_weighted[sl], f_mass[sl] = shifted_stats(zf, f_e[:c], scratch[:c], peak)  # f_e kept
            for layer in range(n_layers if last_is_final else L):  # one layer's [chunk, d_vocab] logits at a time
                if not covered[layer]:
                    continue
                zl = lens.logits_into(flat_streams[layer][sl], locations[layer], z[:c])
                peak = _top_and_target(zl, tgt, top_z[layer, sl], top_ids[layer, sl], target_z[layer, sl], rank[layer, sl],
                                       e[:c])
                _, log_mass[layer, sl], weighted[layer, sl], mass[layer, sl] = shifted_stats(zl, e[:c], None, peak)
                cross[layer, sl] = cross_term(f_e[:c], zl, scratch[:c])
        if last_is_final:
            log_mass[n_layers], weighted[n_layers], mass[n_layers], cross[n_layers] = f_log_mass, f_weighted, f_mass, f_weighted
        peak = top_z[..., 0]  # [layer, rows]
        no_target = flat_targets == NO_TARGET
        top_probs = (top_z - (peak + log_mass)[..., None]).exp()
        ent = log_mass - weighted / mass
        kl = (f_weighted - cross) / f_mass + (log_mass - f_log_mass)  # KL(final || lens), exactly 0 for the final
        tlogp = (target_z - peak - log_mass).masked_fill_(no_target, torch.nan)  # kept as a log: exp underflows
        rank.masked_fill_(no_target, NO_TARGET)
        top_ids, top_probs, ent, kl, rank, tlogp = (t.cpu() if t.dtype == torch.long else t.float().cpu()
                                                    for t in (top_ids, top_probs, ent, kl, rank, tlogp))  # once
        shape = (L, batch, pos)
        return cls(
            tokens=tokens.cpu(), lengths=lengths, top_ids=top_ids.view(*shape, top_k), top_probs=top_probs.view(*shape, top_k),
            entropy=ent.view(shape), kl_to_final=kl.view(shape), targets=targets.cpu(),
            target_rank=rank.view(shape), target_logprob=tlogp.view(shape),
            lens_name=getattr(lens, "name", type(lens).__name__), tokenizer=model.tokenizer,
        )

    # ------------------------------------------------------------- reading
    def token_str(self, ids: np.ndarray | Sequence[int]) -> list[str]:
        """Decoded text of each id (e.g. ' def', '\\n'), or '<id>' when there is no tokenizer; '' for NO_TOKEN."""
        ids = np.asarray(ids).ravel()
        texts = token_texts(self.tokenizer, np.maximum(ids, 0))
        return [text if i >= 0 else "" for text, i in zip(texts, ids)]

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, position) (and per sequence, in a `batch` column, when there are several).

        Columns: [batch,] layer, position, input_token, input_token_id, top_token, top_token_id, top_prob,
        entropy, kl_to_final (nats, KL(final || lens)), target_token, target_token_id, target_rank,
        target_prob, target_logprob (nats), then top{i}_token, top{i}_token_id, top{i}_prob for i = 1..k. Padding positions
        (past a sequence's length) are left out.
        """
        L, B, P = self.entropy.shape
        layer, b, pos = np.meshgrid(np.arange(L), np.arange(B), np.arange(P), indexing="ij")
        keep = (pos < self.lengths.numpy()[b]).ravel()  # drop padding
        layer, b, pos = layer.ravel()[keep], b.ravel()[keep], pos.ravel()[keep]
        flat = lambda t: t.reshape(L * B * P, *t.shape[3:]).numpy()[keep]  # noqa: E731
        tokens = self.tokens.numpy()[b, pos]
        targets = self.targets.numpy()[b, pos]
        top_ids, top_probs = flat(self.top_ids), flat(self.top_probs)
        cols: dict[str, object] = {}
        if B > 1:
            cols["batch"] = b
        cols |= {
            "layer": layer, "position": pos,
            "input_token": self.token_str(tokens), "input_token_id": tokens,
            "top_token": self.token_str(top_ids[:, 0]), "top_token_id": top_ids[:, 0], "top_prob": top_probs[:, 0],
            "entropy": flat(self.entropy), "kl_to_final": flat(self.kl_to_final),
            "target_token": [s if t != NO_TARGET else None for s, t in zip(self.token_str(np.maximum(targets, 0)), targets)],
            "target_token_id": targets, "target_rank": flat(self.target_rank), "target_prob": flat(self.target_prob),
            "target_logprob": flat(self.target_logprob),
        }
        for i in range(self.top_k):
            cols[f"top{i + 1}_token"] = self.token_str(top_ids[:, i])
            cols[f"top{i + 1}_token_id"] = top_ids[:, i]
            cols[f"top{i + 1}_prob"] = top_probs[:, i]
        frame = pd.DataFrame(cols)
        frame.attrs["lens"] = self.lens_name
        return frame


def _top_and_target(z: torch.Tensor, tgt: torch.Tensor, top_z: torch.Tensor, top_ids: torch.Tensor,
                    target_z: torch.Tensor, rank: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """For logits z [rows, d_vocab]: the top-k logits and ids into top_z, top_ids [rows, k], the target's logit
    into target_z [rows] and its rank (tokens of a strictly larger logit) into rank [rows]; returns the peak [rows, 1].
    The rank counts 1.0s in the float buffer `scratch` [rows, d_vocab] (exact below 2^24 tokens): summing a bool
    tensor is 8x slower on the CPU."""
    torch.topk(z, top_z.shape[-1], out=(top_z, top_ids))
    target_z.copy_(z.gather(1, tgt).squeeze(1))
    rank.copy_(torch.gt(z, target_z[:, None], out=scratch).sum(-1))
    return top_z[:, :1]


def tokens_and_lengths(model: HookedTransformer, prompt: str | Sequence[str] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [batch, pos] and the real length of each row: texts are tokenized once and right-padded."""
    if is_text(prompt):
        if model.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids, or load from a folder with tokenizer files")
        tokens, lengths = encode_texts(model.tokenizer, prompt, bos=model.bos_id())  # BOS exactly as to_tokens
        return model.validate_tokens(tokens), lengths
    tokens = model.validate_tokens(prompt)
    return tokens, torch.full((tokens.shape[0],), tokens.shape[1])


def targets_for(model: HookedTransformer, target: int | str | torch.Tensor | None, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Target id per (batch, pos), NO_TARGET where there is none: None = the next input token (none past a
    row's `lengths`), an id or one-token text = that token everywhere, or ids [batch, pos] or [pos]."""
    batch, pos = tokens.shape
    if target is None:  # the next input token, where the sequence has one
        out = torch.full((batch, pos), NO_TARGET, dtype=torch.long)
        out[:, :-1] = tokens[:, 1:].cpu()
        out[torch.arange(pos)[None, :] >= (lengths[:, None] - 1)] = NO_TARGET
        return out
    if isinstance(target, str):
        target = single_token_id(model.tokenizer, target)
    if isinstance(target, int) and not isinstance(target, bool):
        target = torch.full((batch, pos), target, dtype=torch.long)
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be None, an int id, one-token text or a tensor of ids, got {type(target).__name__}")
    target = target.long().cpu()
    if target.shape == (pos,):
        target = target.expand(batch, pos)
    if target.shape != (batch, pos):
        raise ValueError(f"target ids must have shape [batch, pos]={batch, pos} or [pos]={pos}, got {tuple(target.shape)}")
    if ((target != NO_TARGET) & ((target < 0) | (target >= model.cfg.d_vocab))).any():
        raise ValueError(f"target ids must be in [0, {model.cfg.d_vocab}) or {NO_TARGET} for none")
    return target.clone()

"""One tuned-lens training step's losses and translator gradients, with the readout's gradient written by hand.

The objective is sum over streams s and tokens t of KL(p_t || q_st), with p_t the model's own next-token
distribution and q_st the softmax of the model's readout of the translated stream, `readout(h_st + A_s h_st
+ b_s)` (final norm, unembedding, any final soft-cap: `lenskit.pieces.readout.Readout`). Almost all of its FLOPs
are the readout: a [tokens, d_model] @ [d_model, d_vocab] matmul per stream forward, and one more backward
for the gradient with respect to the normed stream (the unembedding is frozen, so never its weight
gradient). Autograd through the whole readout would keep every stream's [tokens, d_vocab] graph alive
until one backward and allocate a dozen [tokens, d_vocab] temporaries per stream. Here instead:

- the d_model-sized part (translator, final norm) runs under autograd, in `TranslatedStreams`: the one
  module with weights, which is what DistributedDataParallel wraps;
- the d_vocab-sized part runs without autograd, a chunk of tokens at a time (every stream of the chunk
  in one matmul), in reused buffers. The KL's gradient with respect to the lens logits is written down
  directly, d/dlogits KL(p || q) = q - p, then taken through the readout's soft-cap where the model has
  one (`Readout.cap_backward_`) and through the unembedding (one matmul);
- then one backward from the normed streams with that gradient, through the norm and the translators.

>>> lens = TunedLens(model)
>>> streams = [(Stream(s), cache.stream(s)) for s in range(model.cfg.n_layers)]   # from a run_with_cache
>>> objective = TranslatedStreams(lens)           # or DistributedDataParallel(TranslatedStreams(lens))
>>> kl = kl_step(objective, model.readout, streams, logits, scale=1 / tokens.numel())  # [n_streams]; grads added
>>> kl.shape, kl.dtype
(torch.Size([6]), torch.float64)
>>> all(p.grad is not None for p in lens.parameters())
True
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from lenskit import Stream
from lenskit.pieces.linear import linear  # a half-precision model's matmuls as its layers run them
from lenskit.pieces.readout import Readout

from ..tuned import TunedLens

Streams = Sequence[tuple[Stream, torch.Tensor]]  # (s, h [batch, pos, d_model]), as training collects them
# About this many bytes of [rows, d_vocab] float32 logits per chunk (two such buffers, and two of the target's
# [tokens, d_vocab]): larger chunks fall out of cache, smaller ones pay for more parallel regions (each waits
# for every thread). Measured on the embedded model with two threads, 2,048-token steps (benchmarks/results.md).
ROW_BYTES = 8 * 2**20


class TranslatedStreams(nn.Module):
    """Every trained stream through its translator and the model's final norm: [stream, tokens, d_model]."""

    def __init__(self, lens: TunedLens) -> None:
        super().__init__()
        self.lens = lens

    def forward(self, streams: Streams) -> torch.Tensor:
        d_model = self.lens.model.cfg.d_model
        readout = self.lens.model.readout  # float32 translators on a bf16/fp16 model; the norm runs in the model's dtype
        return torch.stack([readout.normed(self.lens.transform_hidden(h.reshape(-1, d_model), s)) for s, h in streams])


def kl_step(translate: Callable[[Streams], torch.Tensor], readout: Readout, streams: Streams, final_logits: torch.Tensor,
            scale: float, chunk_tokens: int | None = None) -> torch.Tensor:
    """Summed KL(final || lens) per stream [n_streams] (float64), and `scale` x its gradient added to the
    translators' `.grad` (one backward through `translate`, so DistributedDataParallel reduces it as usual).

    translate: streams -> normed translated streams [stream, tokens, d_model] (a `TranslatedStreams`, maybe
    wrapped); readout: the model's `Readout`; final_logits [batch, pos, d_vocab], the model's own output for
    the same tokens.
    """
    normed = translate(streams)  # [stream, tokens, d_model]
    targets = final_logits.reshape(-1, final_logits.shape[-1])
    with torch.no_grad():
        kl, grad = readout_kl_and_grad(normed.detach(), targets, readout, chunk_tokens)
    normed.backward(grad.mul_(scale))
    return kl


@torch.no_grad()
def readout_kl_and_grad(normed: torch.Tensor, final_logits: torch.Tensor, readout: Readout,
                        chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """normed [stream, tokens, d_model] (already through the final norm), final logits [tokens, d_vocab] ->
    (summed KL(final || lens) per stream [stream] float64, its gradient with respect to `normed`).

    Log-softmax and KL run in float32 whatever the model's dtype. A target token of zero probability adds
    nothing (0 log 0 = 0), as in `metrics.forward_kl`; the final logits must be finite (training checks).
    With z the lens logits, lse their log-sum-exp and p the target: sum_v p log q = sum_v p z - lse sum_v p.
    """
    n_streams, n_tokens, d_model = normed.shape
    weight, d_vocab = readout.weight, readout.d_vocab
    chunk_tokens = even_chunks(n_tokens, chunk_tokens or max(1, ROW_BYTES // (4 * d_vocab) // n_streams))
    rows = chunk_tokens * n_streams
    z, q = torch.empty(2, rows, d_vocab, dtype=torch.float32, device=normed.device)  # reused for every chunk
    logp, p = torch.empty(2, chunk_tokens, d_vocab, dtype=torch.float32, device=normed.device)  # the target's
    kl = torch.zeros(n_streams, dtype=torch.float64, device=normed.device)
    grad = torch.empty_like(normed)
    for t0 in range(0, n_tokens, chunk_tokens):
        t1 = min(t0 + chunk_tokens, n_tokens)
        c, r = t1 - t0, (t1 - t0) * n_streams
        # The target, once per token: p, sum_v p and sum_v p log p (clamped in place: 0 x log 0 adds 0).
        lp = torch.log_softmax(final_logits[t0:t1].float(), dim=-1, out=logp[:c])
        pc = torch.exp(lp, out=p[:c])
        mass = pc.sum(-1)
        neg_entropy = lp.clamp_(min=torch.finfo(lp.dtype).min).mul_(pc).sum(-1)  # [c]
        x = normed[:, t0:t1].reshape(r, d_model)  # [stream * pos-chunk, d_model]
        zc = readout.normed_into(x, z[:r])  # the lens logits, capped where the model caps
        qc = torch.log_softmax(zc, dim=-1, out=q[:r])
        lse = zc[:, 0] - qc[:, 0]
        qc.exp_()
        dz = qc.view(n_streams, c, d_vocab).sub_(pc)  # d KL / d logits = q - p
        readout.cap_backward_(dz, zc.view(n_streams, c, d_vocab))  # through the soft-cap, if any
        p_logits = zc.view(n_streams, c, d_vocab).mul_(pc).sum(-1)  # sum_v p z, [stream, c]; z is used up
        cross = p_logits - lse.view(n_streams, c) * mass
        kl += (neg_entropy - cross).sum(1, dtype=torch.float64)
        dx = linear(dz.reshape(r, d_vocab).to(weight.dtype), weight.t()).float()  # (q - p) W_U
        grad[:, t0:t1] = dx.view(n_streams, c, d_model)
    return kl, grad


def even_chunks(n_tokens: int, at_most: int) -> int:
    """Tokens per chunk: at most `at_most`, in as few chunks as that allows, of equal size but the last (2,048
    tokens at 341 a chunk would leave a last chunk of 2; at 342, six chunks of 342 or 338)."""
    n_chunks = -(-n_tokens // max(1, at_most))
    return max(1, -(-n_tokens // n_chunks))

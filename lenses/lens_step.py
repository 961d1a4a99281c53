"""One tuned-lens training step's losses and translator gradients, computed at matmul speed.

The objective is sum over streams s and tokens t of KL(p_t || q_st), with p_t the model's own next-token
distribution and q_st = softmax(W_U norm(h_st + A_s h_st + b_s)). Almost all of its FLOPs are the
readout: a [tokens, d_model] @ [d_model, d_vocab] matmul per stream forward, and one more backward for
the gradient with respect to the normed stream (the unembedding is frozen, so never its weight gradient).
Autograd through `forward_kl` would also keep every stream's [tokens, d_vocab] graph alive until one
backward, recompute the target's log-softmax for every stream, and allocate a dozen [tokens, d_vocab]
temporaries per stream. Here instead:

- the d_model-sized part (translator, final norm) runs under autograd, in `TranslatedStreams`: the one
  module with weights, which is what DistributedDataParallel wraps;
- the d_vocab-sized part runs without autograd, a few thousand rows at a time (every stream of a chunk of
  tokens in one matmul), in two reused buffers. The KL's gradient with respect to the lens logits is
  written down directly, d/dlogits KL(p || q) = q - p. The target's log-softmax and p W_U [tokens, d_model]
  are computed once per token; p W_U gives both sum_v p logits = x . (p W_U) and the target's half of the
  gradient, (q - p) W_U = q W_U - p W_U, so each chunk of logits is touched only by the two matmuls and
  one softmax (on the CPU its log-sum-exp is read off q at the target's top-1 token, lse = z_i - log q_i);
- then one backward from the normed streams with that gradient, through the norm and the translators.

The readout this assumes is the model's: `unembed(ln_final(h))`, a final norm then a linear unembedding,
then, for a model with a final soft-cap c (Gemma 2), logits = c tanh(z / c) of the unembedding's output z.
With a cap the shortcut through p W_U does not hold (the KL is not linear in z), so each chunk computes the
capped logits in full and the gradient is written out with the tanh's derivative:
d KL / d z = (q - p) (1 - tanh(z / c)^2).

>>> objective = TranslatedStreams(lens)           # or DistributedDataParallel(TranslatedStreams(lens))
>>> kl = kl_step(objective, model.unembed, streams, final_logits, scale=1 / tokens)  # [n_streams]; grads added
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from lenskit import Stream
from lenskit.linear import linear, linear_into  # a half-precision model's matmuls as its layers run them

from .metrics import target_sums
from .tuned import TunedLens

Streams = Sequence[tuple[Stream, torch.Tensor]]  # (s, h [batch, pos, d_model]), as training collects them
# About this many bytes of [rows, d_vocab] float32 logits per chunk (two buffers). Measured on the embedded model
# with two threads (2,048-token steps): 8 MiB 0.374-0.39 s a step, 16 MiB 0.388-0.39, 32 MiB 0.397-0.417, 4 MiB
# 0.42: larger chunks fall out of cache, smaller ones pay for more parallel regions (each waits for every thread).
ROW_BYTES = 8 * 2**20
MIN_ROWS = 512  # below this the readout matmul rereads W_U too often to run at full speed


class TranslatedStreams(nn.Module):
    """Every trained stream through its translator and the model's final norm: [stream, tokens, d_model]."""

    def __init__(self, lens: TunedLens) -> None:
        super().__init__()
        self.lens = lens

    def forward(self, streams: Streams) -> torch.Tensor:
        norm = self.lens.model.ln_final
        d_model = self.lens.model.cfg.d_model
        dtype = norm.weight.dtype  # float32 translators on a bf16/fp16 model; the norm runs in the model's dtype
        return torch.stack([norm(self.lens.transform_hidden(h.reshape(-1, d_model), s).to(dtype)) for s, h in streams])


def kl_step(translate: Callable[[Streams], torch.Tensor], unembed: nn.Linear, streams: Streams, final_logits: torch.Tensor,
            scale: float, chunk_tokens: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Summed KL(final || lens) per stream [n_streams] (float64), and `scale` x its gradient added to the
    translators' `.grad` (one backward through `translate`, so DistributedDataParallel reduces it as usual).

    translate: streams -> normed translated streams [stream, tokens, d_model] (a `TranslatedStreams`, maybe
    wrapped); final_logits [batch, pos, d_vocab], the model's own output for the same tokens; softcap, the
    model's final logit soft-cap (`model.cfg.final_softcap`), None for none.
    """
    normed = translate(streams)  # [stream, tokens, d_model]
    targets = final_logits.reshape(-1, final_logits.shape[-1])
    with torch.no_grad():
        if softcap is None:
            kl, grad = readout_kl_and_grad(normed.detach(), targets, unembed, chunk_tokens)
        else:
            kl, grad = capped_readout_kl_and_grad(normed.detach(), targets, unembed, softcap, chunk_tokens)
    normed.backward(grad.mul_(scale))
    return kl


@torch.no_grad()
def readout_kl_and_grad(normed: torch.Tensor, final_logits: torch.Tensor, unembed: nn.Linear,
                        chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """normed [stream, tokens, d_model], final logits [tokens, d_vocab] -> (summed KL(final || unembed(normed))
    per stream [stream] float64, its gradient with respect to `normed` [stream, tokens, d_model]).

    Log-softmax and KL run in float32 whatever the model's dtype. A target token of zero probability adds
    nothing (0 log 0 = 0), as in `metrics.forward_kl`; the final logits must be finite (training checks).
    """
    n_streams, n_tokens, d_model = normed.shape
    weight, bias = unembed.weight, unembed.bias  # [d_vocab, d_model], [d_vocab] or None
    d_vocab = weight.shape[0]
    chunk_tokens = even_chunks(n_tokens, chunk_tokens or max(1, max(MIN_ROWS, ROW_BYTES // (4 * d_vocab)) // n_streams))
    rows = chunk_tokens * n_streams
    logits = torch.empty(rows, d_vocab, dtype=torch.float32, device=normed.device)  # reused for every chunk
    q = torch.empty_like(logits)
    scratch = torch.empty(2, chunk_tokens, d_vocab, dtype=torch.float32, device=normed.device)  # the target's
    kl = torch.zeros(n_streams, dtype=torch.float64, device=normed.device)
    grad = torch.empty_like(normed)
    for t0 in range(0, n_tokens, chunk_tokens):
        t1 = min(t0 + chunk_tokens, n_tokens)
        c, r = t1 - t0, (t1 - t0) * n_streams
        # The target, once per token: its top-1, sum_v p log p, sum_v p, and p through the unembedding.
        target = target_sums(final_logits[t0:t1], weight, bias, scratch)
        pw = target["p_w"]  # [c, d_model]
        x = normed[:, t0:t1].transpose(0, 1).reshape(c, n_streams, d_model)  # [pos-chunk, stream, d_model]
        out = linear_into(x.reshape(r, d_model), weight, bias, logits[:r])  # the model's dtype in the matmul only
        lse = softmax_and_lse(out, q[:r], target["top"].repeat_interleave(n_streams)).view(c, n_streams)
        # sum_v p log q = sum_v p logits - lse sum_v p, and sum_v p logits = x . (p W_U) (+ p . bias)
        p_logits = torch.bmm(x.float(), pw.unsqueeze(-1)).view(c, n_streams) + target["p_b"].unsqueeze(-1)
        cross = p_logits - lse * target["mass"].unsqueeze(-1)
        kl += (target["neg_entropy"].unsqueeze(-1) - cross).sum(0, dtype=torch.float64)
        # d KL / d logits = q - p, so d KL / d x = q W_U - p W_U.
        dx = linear(q[:r].to(weight.dtype), weight.t()).float().view(c, n_streams, d_model) - pw.unsqueeze(1)
        grad[:, t0:t1] = dx.transpose(0, 1)
    return kl, grad


@torch.no_grad()
def capped_readout_kl_and_grad(normed: torch.Tensor, final_logits: torch.Tensor, unembed: nn.Linear, softcap: float,
                               chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`readout_kl_and_grad` for a readout ending in a soft-cap: lens logits c tanh(unembed(normed) / c)."""
    n_streams, n_tokens, d_model = normed.shape
    weight, bias = unembed.weight, unembed.bias
    chunk_tokens = even_chunks(n_tokens, chunk_tokens or max(1, max(MIN_ROWS, ROW_BYTES // (4 * weight.shape[0])) // n_streams))
    kl = torch.zeros(n_streams, dtype=torch.float64, device=normed.device)
    grad = torch.empty_like(normed)
    for t0 in range(0, n_tokens, chunk_tokens):
        t1 = min(t0 + chunk_tokens, n_tokens)
        logp = torch.log_softmax(final_logits[t0:t1].float(), dim=-1)  # [c, d_vocab]
        p = logp.exp()
        x = normed[:, t0:t1]  # [stream, c, d_model]
        z = linear(x.to(weight.dtype), weight).float()  # [stream, c, d_vocab]
        if bias is not None:
            z += bias.float()
        capped = torch.tanh(z / softcap)
        logq = torch.log_softmax(capped * softcap, dim=-1)
        kl += (p * (logp - logq)).nan_to_num_(0.0).sum((1, 2), dtype=torch.float64)  # 0 log 0 = 0 where p = 0
        dz = (logq.exp_() - p) * (1 - capped.square_())  # d KL / d logits, then through the cap
        grad[:, t0:t1] = linear(dz.to(weight.dtype), weight.t()).float()
    return kl, grad


def softmax_and_lse(logits: torch.Tensor, q: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """q := softmax(logits) in place of the buffer `q` [rows, d_vocab]; returns log sum_v exp(logits) [rows].

    On the CPU the log-sum-exp is read off q at one token per row, `ref` (the target's top-1, where q is rarely
    tiny): lse = z_i - log q_i, one pass fewer than a log-softmax then an exp; rows where that q is below 1e-30
    (too small to carry its digits) take theirs in full. That check waits for its result, so on other devices,
    which must not synchronise inside a step, the log-softmax comes first and q is its exp."""
    if logits.device.type != "cpu":
        torch.log_softmax(logits, dim=-1, out=q)
        lse = logits[:, 0] - q[:, 0]
        q.exp_()
        return lse
    torch.softmax(logits, dim=-1, out=q)
    q_ref = q.gather(1, ref[:, None]).squeeze(1)
    lse = logits.gather(1, ref[:, None]).squeeze(1) - q_ref.log()
    tiny = q_ref < 1e-30
    if tiny.any():
        lse[tiny] = torch.logsumexp(logits[tiny], dim=-1)
    return lse


def even_chunks(n_tokens: int, at_most: int) -> int:
    """Tokens per chunk: at most `at_most`, in as few chunks as that allows, of equal size but the last (2,048
    tokens at 341 a chunk would leave a last chunk of 2; at 342, six chunks of 342 or 338)."""
    n_chunks = -(-n_tokens // max(1, at_most))
    return max(1, -(-n_tokens // n_chunks))

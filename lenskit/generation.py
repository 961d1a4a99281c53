"""Text continuation: greedy decoding, or sampling with temperature, top-k and top-p from a seedable generator.

No KV cache: each step reruns the window, which is simple and exact, and fast enough for the short
continuations interpretability work needs. Texts of different lengths each continue their own text: the batch
is kept right-padded, where causal attention leaves each row's real positions as they are alone, and each row's
next token is read at its own last position.

>>> model.generate("def f(", max_new_tokens=10)                                   # greedy
>>> g = torch.Generator().manual_seed(0)
>>> model.generate("def f(", max_new_tokens=10, do_sample=True, temperature=0.8, top_k=50, generator=g)
>>> out = model.generate(["a", "def add(a, b):"], 5)   # left-padded: out[:, -5:] continues each text
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import TYPE_CHECKING

import torch

from .io.text import encode_texts, is_text, pad_token_id

if TYPE_CHECKING:
    from .model import HookedTransformer, TokensLike


def next_token(logits: torch.Tensor, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token [batch, 1] from last-position logits [batch, d_vocab].

    Greedy (argmax) unless `do_sample`; temperature 0 is greedy too. Sampling draws from
    softmax(logits / temperature) restricted to the `top_k` most likely tokens and/or the smallest set
    whose probability reaches `top_p`.
    """
    if not do_sample or temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float()
    # Shifted so that the largest is 0 before dividing: a tiny temperature sends the others to -inf, never one to +inf.
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]  # [batch, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs >= top_p  # the tokens ranked above already hold top_p
        logits = logits.masked_fill(torch.empty_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)  # [batch, 1]


def _is_real(x: object) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
                   do_sample: bool = False, generator: torch.Generator | None = None) -> None:
    """Refuse, by name and value, any decoding argument outside its domain."""
    if not isinstance(max_new_tokens, Integral) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be True or False, got {do_sample!r}")
    if not (_is_real(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, Integral) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and not (_is_real(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__} {generator!r:.40}")


def _prompts(model: "HookedTransformer", tokens: "TokensLike") -> tuple[torch.Tensor, list[int], int]:
    """Right-padded prompt ids [batch, pos], each row's real length, and the pad id. A batch of texts has its
    own lengths; a token tensor's rows are taken as whole (its padding cannot be told from its tokens)."""
    if isinstance(tokens, (list, tuple)) and is_text(tokens):
        bos = model.bos_id()  # also: a clear error for a model without a tokenizer
        if not all(isinstance(t, str) for t in tokens):
            raise TypeError(f"generate takes one text, a list of texts or token ids; got a list mixing texts and "
                            f"{next(type(t).__name__ for t in tokens if not isinstance(t, str))}")
        ids, lengths = encode_texts(model.tokenizer, tokens, bos=bos)
        return model.validate_tokens(ids), lengths.tolist(), pad_token_id(model.tokenizer)
    ids = model.validate_tokens(tokens)
    return ids, [ids.shape[1]] * ids.shape[0], 0


@torch.no_grad()
def generate(model: "HookedTransformer", tokens: "TokensLike", max_new_tokens: int = 20, *, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue `tokens` by `max_new_tokens` (see `next_token`): ids [batch, pos + max_new_tokens].

    Each of several texts continues its own text, as it would alone; rows of different lengths come back
    left-padded with the tokenizer's pad id, so `out[:, -max_new_tokens:]` is every row's continuation.
    Past n_ctx tokens, each row's window slides: its next token is predicted from its last n_ctx tokens.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p, do_sample, generator)
    ids, lengths, pad = _prompts(model, tokens)
    batch, n_ctx = ids.shape[0], model.cfg.n_ctx
    seqs = torch.cat([ids, ids.new_full((batch, max_new_tokens), pad)], dim=1)  # row r's text: seqs[r, :lengths[r]]
    rows = torch.arange(batch, device=ids.device)
    for step in range(max_new_tokens):
        starts = [max(0, n - n_ctx) for n in lengths]  # each row's window: its last n_ctx tokens
        width = max(n - s for n, s in zip(lengths, starts))
        if len(set(starts)) == 1:
            window = seqs[:, starts[0]:starts[0] + width]  # [batch, width]
        else:
            at = torch.tensor(starts, device=ids.device)[:, None] + torch.arange(width, device=ids.device)
            window = seqs.gather(1, at)  # [batch, width]; a short row's window ends in padding, which it never sees
        last = torch.tensor([n - s - 1 for n, s in zip(lengths, starts)], device=ids.device)
        logits = model(window)[rows, last]  # [batch, d_vocab]
        if logits.isnan().any():
            raise ValueError(f"generate: the model's logits at step {step} are NaN, so there is no next token; "
                             "check the weights (from_pretrained checks them unless check_finite=False) and any hooks")
        seqs[rows, torch.tensor(lengths, device=ids.device)] = next_token(logits, do_sample, temperature, top_k, top_p,
                                                                          generator)[:, 0]
        lengths = [n + 1 for n in lengths]
    width = max(lengths)
    if all(n == width for n in lengths):
        return seqs
    out = seqs.new_full((batch, width), pad)
    for r, n in enumerate(lengths):
        out[r, width - n:] = seqs[r, :n]
    return out

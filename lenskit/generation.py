"""Text continuation: greedy decoding, or sampling with temperature, top-k and top-p from a seedable generator.

No KV cache: each step reruns the window, which is simple and exact, and fast enough for the short
continuations interpretability work needs.

>>> model.generate("def f(", max_new_tokens=10)                                   # greedy
>>> g = torch.Generator().manual_seed(0)
>>> model.generate("def f(", max_new_tokens=10, do_sample=True, temperature=0.8, top_k=50, generator=g)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

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
    logits = logits.float() / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]  # [batch, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs >= top_p  # the tokens ranked above already hold top_p
        logits = logits.masked_fill(torch.empty_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)  # [batch, 1]


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


@torch.no_grad()
def generate(model: "HookedTransformer", tokens: "TokensLike", max_new_tokens: int = 20, *, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue `tokens` by `max_new_tokens`: [batch, pos + max_new_tokens] token ids (see `next_token`)."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    tokens = model.validate_tokens(tokens)
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -model.cfg.n_ctx:])[:, -1]  # [batch, d_vocab]
        tokens = torch.cat([tokens, next_token(logits, do_sample, temperature, top_k, top_p, generator)], dim=1)
    return tokens

"""Text continuation: greedy decoding, or sampling with temperature, top-k, top-p and a frequency penalty from a
seedable generator, with a KV cache (lenskit.kv_cache) or by rerunning the window at every step.

Texts of different lengths each continue their own text, as each does alone. The batch is kept right-padded, so
every row's real tokens sit at the same positions. With the cache, the shortest prompt is run whole, then each
forward feeds every row the token at the next shared position: a row still inside its prompt its next prompt
token, the others the token just chosen for them. So each row attends to exactly its own tokens, and the cached
result is the uncached one to float rounding (tests/test_generate_cache.py checks greedy tokens on every family).
Past n_ctx tokens each row's window slides to its last n_ctx tokens, which a cache cannot do (every cached key
would move), so those steps rerun the window.

>>> model.generate("def f(", max_new_tokens=10, return_type="str")                 # greedy
'def f(self, f):\\n        self.check_pat'
>>> g = torch.Generator().manual_seed(0)
>>> out = model.generate("def f(", max_new_tokens=10, do_sample=True, temperature=0.8, top_k=50, generator=g)
>>> again = model.generate("def f(", max_new_tokens=10, do_sample=True, temperature=0.8, top_k=50,
...                        generator=torch.Generator().manual_seed(0))
>>> out.shape, torch.equal(out, again)     # 3 prompt tokens + 10; the same seed, the same tokens
(torch.Size([1, 13]), True)
>>> out = model.generate(["a", "def add(a, b):"], 5)   # out[:, -5:] continues each text
>>> out.shape
torch.Size([2, 12])
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import TYPE_CHECKING, Sequence

import torch

from .io.text import encode_texts, is_text, pad_token_id
from .kv_cache import KVCache

if TYPE_CHECKING:
    from .model import HookedTransformer, TokensLike

RETURN_TYPES = ("tokens", "str", "input")


def next_token(logits: torch.Tensor, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None,
               penalty: torch.Tensor | None = None) -> torch.Tensor:
    """The next token [batch, 1] from last-position logits [batch, d_vocab].

    Greedy (argmax) unless `do_sample`; temperature 0 is greedy too. Sampling draws from
    softmax(logits / temperature - penalty) restricted to the `top_k` most likely tokens and/or the smallest set
    whose probability reaches `top_p`; `penalty` [batch, d_vocab] (TransformerLens's frequency penalty: its
    weight times each token's count so far) applies only when sampling, as in TransformerLens.
    """
    if not do_sample or temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float()
    # Shifted so that the largest is 0 before dividing: a tiny temperature sends the others to -inf, never one to +inf.
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if penalty is not None:
        logits = logits - penalty
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


def _is_int(x: object) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
                   do_sample: bool = False, generator: torch.Generator | None = None, freq_penalty: float = 0.0) -> None:
    """Refuse, by name and value, any decoding argument outside its domain."""
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be True or False, got {do_sample!r}")
    if not (_is_real(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and not (_is_real(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__} {generator!r:.40}")
    if not (_is_real(freq_penalty) and math.isfinite(freq_penalty) and freq_penalty >= 0):
        raise ValueError(f"freq_penalty must be a finite number >= 0, got {freq_penalty!r}")


def _check_options(stop_at_eos: bool, use_past_kv_cache: bool, return_type: str, padding_side: str | None,
                   verbose: bool) -> None:
    for name, value in (("stop_at_eos", stop_at_eos), ("use_past_kv_cache", use_past_kv_cache), ("verbose", verbose)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if return_type not in RETURN_TYPES:
        raise ValueError(f"return_type must be one of {', '.join(map(repr, RETURN_TYPES))}, got {return_type!r}")
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"padding_side must be 'left', 'right' or None (left), got {padding_side!r}")


def _prompts(model: "HookedTransformer", tokens: "TokensLike",
             prepend_bos: bool | None = None) -> tuple[torch.Tensor, list[int], int]:
    """Right-padded prompt ids [batch, pos], each row's real length, and the pad id. A batch of texts has its
    own lengths; a token tensor's rows are taken as whole (its padding cannot be told from its tokens)."""
    if isinstance(tokens, (list, tuple)) and is_text(tokens):
        bos = model.bos_id(prepend_bos)  # also: a clear error for a model without a tokenizer
        if not all(isinstance(t, str) for t in tokens):
            raise TypeError(f"generate takes one text, a list of texts or token ids; got a list mixing texts and "
                            f"{next(type(t).__name__ for t in tokens if not isinstance(t, str))}")
        ids, lengths = encode_texts(model.tokenizer, tokens, bos=bos)
        return model.validate_tokens(ids), lengths.tolist(), pad_token_id(model.tokenizer)
    ids = model.validate_tokens(tokens, prepend_bos) if isinstance(tokens, str) else model.validate_tokens(tokens)
    return ids, [ids.shape[1]] * ids.shape[0], 0


def _stop_tokens(model: "HookedTransformer", stop_at_eos: bool,
                 eos_token_id: int | Sequence[int] | None) -> tuple[list[int], int]:
    """The ids that end a row, and the id that fills a row after it has ended ([] and 0: no stopping).
    None: the tokenizer's EOS, and no stopping for a model with neither a tokenizer nor an EOS."""
    if not stop_at_eos:
        return [], 0
    tokenizer_eos = None if model.tokenizer is None else model.tokenizer.eos_token_id
    if eos_token_id is None:
        return ([], 0) if tokenizer_eos is None else ([tokenizer_eos], tokenizer_eos)
    ids = [eos_token_id] if _is_int(eos_token_id) else eos_token_id
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not ids or not all(
            _is_int(i) and 0 <= i < model.cfg.d_vocab for i in ids):
        raise ValueError(f"eos_token_id must be a token id in [0, {model.cfg.d_vocab}) or a non-empty list of them, "
                         f"got {eos_token_id!r}")
    ids = [int(i) for i in ids]
    return ids, ids[0] if _is_int(eos_token_id) or tokenizer_eos is None else tokenizer_eos


class _Rows:
    """Each row's tokens so far, seqs[r, :length[r]] (right-padded), and what it still needs: a row is done at
    `goal` tokens or once it has chosen a stop token."""

    def __init__(self, ids: torch.Tensor, lengths: list[int], max_new_tokens: int, pad: int, stops: list[int]) -> None:
        batch = ids.shape[0]
        self.seqs = torch.cat([ids, ids.new_full((batch, max_new_tokens), pad)], dim=1)  # [batch, pos + max_new_tokens]
        self.prompt = torch.tensor(lengths)
        self.length = self.prompt.clone()  # on the CPU: bookkeeping, read at every step
        self.goal = self.prompt + max_new_tokens
        self.stopped = torch.zeros(batch, dtype=torch.bool)
        self.stops = torch.tensor(stops, dtype=torch.long)

    def waiting(self) -> torch.Tensor:
        """[batch] bool: rows that still need a token."""
        return ~self.stopped & (self.length < self.goal)

    def take(self, logits: torch.Tensor, rows: torch.Tensor, step: int, choose) -> None:
        """Give each row in `rows` ([batch] bool) its next token, chosen from logits [batch, d_vocab]."""
        if logits[rows.to(logits.device)].isnan().any():
            raise ValueError(f"generate: the model's logits at step {step} are NaN, so there is no next token; "
                             "check the weights (from_pretrained checks them unless check_finite=False) and any hooks")
        chosen = choose(logits, self)[:, 0].cpu()  # [batch]; every row is drawn, so a seed's draws do not depend on which
        at = rows.nonzero()[:, 0]
        self.seqs[at.to(self.seqs.device), self.length[at].to(self.seqs.device)] = chosen[at].to(self.seqs.device)
        self.length[at] += 1
        self.stopped[at] |= torch.isin(chosen[at], self.stops)

    def counts(self, d_vocab: int) -> torch.Tensor:
        """[batch, d_vocab]: how often each token occurs in each row so far (padding excluded)."""
        real = torch.arange(self.seqs.shape[1]) < self.length[:, None]  # [batch, pos]
        return torch.zeros(self.seqs.shape[0], d_vocab, device=self.seqs.device).scatter_add_(
            1, self.seqs, real.to(self.seqs.device, torch.float32))


def _cached_steps(model: "HookedTransformer", rows: _Rows, choose, bar) -> int:
    """Run rows on from a KV cache while the shared position is inside n_ctx; the number of steps taken."""
    cache = KVCache(model.cfg, rows.seqs.shape[0])
    p = int(rows.length.min())
    logits = model(rows.seqs[:, :p], past_kv_cache=cache)[:, -1]  # [batch, d_vocab], predicting position p
    step = 0
    while True:
        at = rows.waiting() & (rows.length == p)  # rows whose next token these logits predict
        if at.any():
            rows.take(logits, at, step, choose)
            step += 1
            bar.update(rows)
        if not rows.waiting().any() or p == model.cfg.n_ctx:
            return step
        logits = model(rows.seqs[:, p:p + 1], past_kv_cache=cache)[:, -1]  # a waiting row's token, or a prompt's
        p += 1


def _window_steps(model: "HookedTransformer", rows: _Rows, choose, bar, step: int = 0) -> None:
    """Run rows on by rerunning each row's window (its last n_ctx tokens) at every step."""
    n_ctx, device = model.cfg.n_ctx, rows.seqs.device
    while rows.waiting().any():
        lengths = rows.length.tolist()
        starts = [max(0, n - n_ctx) for n in lengths]
        width = max(n - s for n, s in zip(lengths, starts))
        if len(set(starts)) == 1:
            window = rows.seqs[:, starts[0]:starts[0] + width]  # [batch, width]
        else:
            at = torch.tensor(starts, device=device)[:, None] + torch.arange(width, device=device)
            window = rows.seqs.gather(1, at)  # [batch, width]; a short row's window ends in padding, which it never sees
        last = torch.tensor([n - s - 1 for n, s in zip(lengths, starts)], device=device)
        logits = model(window)[torch.arange(len(lengths), device=device), last]  # [batch, d_vocab]
        rows.take(logits, rows.waiting(), step, choose)
        step += 1
        bar.update(rows)


class _Progress:
    """A tqdm bar over max_new_tokens, at the count of the row furthest behind (off unless verbose)."""

    def __init__(self, total: int, verbose: bool) -> None:
        self.bar = None
        if verbose:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="generate", unit="token")

    def update(self, rows: _Rows) -> None:
        if self.bar is not None:
            done = torch.where(rows.waiting(), rows.length - rows.prompt, rows.goal - rows.prompt)
            self.bar.update(int(done.min()) - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@torch.no_grad()
def generate(model: "HookedTransformer", tokens: "TokensLike", max_new_tokens: int = 20, *, stop_at_eos: bool = True,
             eos_token_id: int | Sequence[int] | None = None, do_sample: bool = False, top_k: int | None = None,
             top_p: float | None = None, temperature: float = 1.0, freq_penalty: float = 0.0,
             use_past_kv_cache: bool = True, prepend_bos: bool | None = None, padding_side: str | None = None,
             return_type: str = "tokens", verbose: bool = False,
             generator: torch.Generator | None = None) -> torch.Tensor | str | list[str]:
    """Continue `tokens` by up to `max_new_tokens` (see `next_token`): ids [batch, pos + n_new].

    Each of several texts continues its own text, as it would alone; rows of different lengths come back
    left-padded with the tokenizer's pad id (`padding_side="right"`: each row's text and continuation, then
    padding), so `out[:, -n_new:]` is every row's continuation. With `stop_at_eos` a row ends at a stop token
    (`eos_token_id`, an id or a list; None: the tokenizer's EOS, and no stop without one) and is filled with EOS
    after it, and generation ends when every row has ended, so n_new may be below max_new_tokens.

    `use_past_kv_cache` (lenskit.kv_cache) feeds each new token alone; the result is the uncached one's to float
    rounding, and hooks fire on every forward, each seeing the new position only ([batch, 1, ...]).
    `return_type`: "tokens"; "str" (each row's text, special tokens skipped: one string for one text in, else a
    list); "input" (the input's kind: text in, text out). `prepend_bos` applies to text, as in `to_tokens`;
    `verbose` shows a tqdm bar. `freq_penalty` lowers each sampled token's logit by the weight times its count
    in the row so far, as TransformerLens does (greedy decoding ignores it there too). The defaults are
    transformers' greedy `generate`: no sampling, stop at the tokenizer's EOS.
    Past n_ctx tokens, each row's window slides: its next token is predicted from its last n_ctx tokens.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p, do_sample, generator, freq_penalty)
    _check_options(stop_at_eos, use_past_kv_cache, return_type, padding_side, verbose)
    if return_type == "str" and model.tokenizer is None:
        raise ValueError("return_type='str' needs a tokenizer, and this model has none; use return_type='tokens'")
    ids, lengths, pad = _prompts(model, tokens, prepend_bos)
    stops, fill = _stop_tokens(model, stop_at_eos, eos_token_id)
    rows = _Rows(ids, lengths, max_new_tokens, pad, stops)
    penalise = freq_penalty > 0 and do_sample

    def choose(logits: torch.Tensor, rows: _Rows) -> torch.Tensor:
        penalty = freq_penalty * rows.counts(logits.shape[-1]) if penalise else None
        return next_token(logits, do_sample, temperature, top_k, top_p, generator, penalty)

    bar = _Progress(max_new_tokens, verbose)
    try:
        step = _cached_steps(model, rows, choose, bar) if max_new_tokens > 0 and use_past_kv_cache else 0
        _window_steps(model, rows, choose, bar, step)
    finally:
        bar.close()
    return _output(model, rows, tokens, fill, pad, padding_side, return_type)


def _output(model: "HookedTransformer", rows: _Rows, tokens: "TokensLike", fill: int, pad: int,
            padding_side: str | None, return_type: str) -> torch.Tensor | str | list[str]:
    """Every row with n_new new tokens (the most any row made; ended rows filled), laid out and typed as asked."""
    n_new = int((rows.length - rows.prompt).max()) if len(rows.prompt) else 0
    for r in rows.stopped.nonzero()[:, 0].tolist():
        end = int(rows.prompt[r]) + n_new
        rows.seqs[r, int(rows.length[r]):end] = fill
        rows.length[r] = end
    lengths = rows.length.tolist()
    width = max(lengths)
    if all(n == width for n in lengths):
        out = rows.seqs[:, :width]
    else:
        out = rows.seqs.new_full((len(lengths), width), pad)
        for r, n in enumerate(lengths):
            at = slice(0, n) if padding_side == "right" else slice(width - n, width)
            out[r, at] = rows.seqs[r, :n]
    if return_type == "tokens" or (return_type == "input" and not is_text(tokens)):
        return out
    texts = [model.tokenizer.decode(rows.seqs[r, :n].tolist(), skip_special_tokens=True) for r, n in enumerate(lengths)]
    return texts[0] if isinstance(tokens, str) else texts

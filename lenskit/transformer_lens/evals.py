"""`transformer_lens.evals`: the quick checks that need no data download.

`sanity_check` (the loss on one paragraph), `induction_loss` (the loss on the repeated half of random token
sequences, which is low only where a model has induction heads) and `evaluate_on_dataset` (the mean loss over a
DataLoader of {"tokens": [batch, pos]}). TransformerLens's loaders of named datasets (`make_pile_data_loader`,
`make_wiki_data_loader`, `make_owt_data_loader`, `make_code_data_loader`, `evaluate`) download them, and are not
here: tokenize your own text with `utils.tokenize_and_concatenate` and pass a DataLoader of it.

>>> from lenskit.transformer_lens import evals
>>> loss = evals.induction_loss(model, subseq_len=64, generator=torch.Generator().manual_seed(0))
>>> round(loss.item(), 1)      # nats; the embedded model has no induction heads: above ln(d_vocab) = 8.3
11.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

from lenskit.io.text import adds_bos
from lenskit.losses import next_token_loss

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["SANITY_TEXT", "evaluate_on_dataset", "induction_loss", "make_induction_tokens", "sanity_check"]

SANITY_TEXT = ("A lens is only as useful as the questions it lets us ask. When we can watch each layer of a network "
               "write into a shared stream, we can ask which parts carried a fact, where a prediction first "
               "appeared, and what changes when one of them is removed.")
"""The paragraph `sanity_check` scores: plain English, so a trained English model's loss on it is low."""

# The token ids the random sequences are drawn from, [low, high): TransformerLens's range, which skips the
# first ids (bytes and punctuation in GPT-2's vocabulary); cut to the model's vocabulary where it is smaller.
INDUCTION_IDS = (100, 20000)


def sanity_check(model: Any) -> torch.Tensor:
    """The model's mean next-token loss (nats) on `SANITY_TEXT`: a rough check that a trained English model
    loaded correctly (a few nats; near ln(d_vocab) for a broken or untrained one)."""
    return model(SANITY_TEXT, return_type="loss")


def make_induction_tokens(model: Any, batch_size: int = 4, subseq_len: int = 384, prepend_bos: bool | None = None,
                          tokenizer: "PreTrainedTokenizerBase | None" = None, device: str | torch.device | None = None, *,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """Random token sequences, each repeated once: [batch_size, 2 * subseq_len] ids, the first half drawn
    uniformly from `INDUCTION_IDS` (with torch's global generator, or `generator`), on the CPU then moved to
    `device` (None: the model's). `subseq_len` is cut to n_ctx // 2 so both halves fit the context.

    With BOS (`prepend_bos`, None: as the model's text input does), position 0 becomes the BOS id: it replaces
    the first random token, so the length stays 2 * subseq_len, as in TransformerLens.
    """
    n_ctx, d_vocab = model.cfg.n_ctx, model.cfg.d_vocab
    for name, value in (("batch_size", batch_size), ("subseq_len", subseq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    subseq_len = min(subseq_len, n_ctx // 2)
    low, high = INDUCTION_IDS if d_vocab > INDUCTION_IDS[0] else (0, d_vocab)
    first = torch.randint(low, min(high, d_vocab), (batch_size, subseq_len), generator=generator)  # [batch, subseq]
    tokens = first.repeat(1, 2)  # [batch, 2 * subseq]
    bos = _bos_id(model, tokenizer, prepend_bos)
    if bos is not None:
        tokens[:, 0] = bos
    return tokens.to(model.cfg.device if device is None else device)


def induction_loss(model: Any, tokenizer: "PreTrainedTokenizerBase | None" = None, batch_size: int = 4,
                   subseq_len: int = 384, prepend_bos: bool | None = None, device: str | torch.device | None = None, *,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Mean next-token loss (nats, a scalar) on the repeated half of `make_induction_tokens`'s sequences.

    As in TransformerLens, the predictions counted are those of positions subseq_len + 1 onward (the
    repeat's third token on): a model that copies from the first half gets them nearly free. `subseq_len` is
    cut to n_ctx // 2 first.
    """
    tokens = make_induction_tokens(model, batch_size, subseq_len, prepend_bos, tokenizer, device, generator=generator)
    half = tokens.shape[1] // 2
    with torch.no_grad():
        logits = model(tokens, return_type="logits")  # [batch, 2 * half, d_vocab]
    return next_token_loss(logits, tokens, per_token=True)[:, half + 1:].mean()


def evaluate_on_dataset(model: Any, data_loader: Iterable[dict], truncate: int = 100,
                        device: str | torch.device | None = None) -> float:
    """The mean over batches of the model's mean next-token loss on each batch's "tokens" [batch, pos].

    As TransformerLens counts, it stops after truncate + 1 batches. `device` (None: the model's) is where the
    tokens go.
    """
    device = model.cfg.device if device is None else device
    total, batches = 0.0, 0
    with torch.no_grad():
        for batch in data_loader:
            if "tokens" not in batch:
                raise ValueError(f"each batch must be a dict with 'tokens' [batch, pos], got keys {sorted(batch)}")
            total += model(batch["tokens"].to(device), return_type="loss").mean().item()
            batches += 1
            if batches > truncate:
                break
    if batches == 0:
        raise ValueError("the data loader yielded no batches")
    return total / batches


def _bos_id(model: Any, tokenizer: "PreTrainedTokenizerBase | None", prepend_bos: bool | None) -> int | None:
    """The BOS id the sequences start with, or None: `prepend_bos`, else the model's default, else (lenskit's
    default of None) whatever `tokenizer` (the model's, if not given) does with text."""
    want = model.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
    if want is False:
        return None
    if tokenizer is None:
        return model.bos_id(prepend_bos)
    if want is None and not adds_bos(tokenizer):
        return None
    if tokenizer.bos_token_id is None:
        raise ValueError("prepend_bos asks for BOS, but the tokenizer has no bos_token_id; pass prepend_bos=False")
    return tokenizer.bos_token_id

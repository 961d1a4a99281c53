"""Text and tokens in one place: is this text?, text to padded token ids with each row's length, one-token
text to its id, a token shown as a reader should see it (`show_token`, `decode_token`), and the model's own text
methods (`TextMethods`: `to_tokens`, `to_str_tokens`, `to_string`, ...)."""

from __future__ import annotations

import unicodedata
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .tokenizer import tokenizer_failures

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..model import TokensLike


def is_text(x: Any) -> bool:
    """A string, or a non-empty list or tuple of strings (a batch of texts)."""
    return isinstance(x, str) or (isinstance(x, (list, tuple)) and bool(x) and isinstance(x[0], str))


def pad_token_id(tokenizer: "PreTrainedTokenizerBase") -> int:
    """The id that right-pads a batch of texts: the tokenizer's pad token, else its end-of-text token, else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def right_pad(rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """Token id rows of different lengths -> LongTensor [batch, max length], right-padded with `pad`."""
    out = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def check_unicode(texts: Sequence[str]) -> None:
    """Refuse text a tokenizer cannot encode: a lone surrogate, e.g. from non-UTF-8 bytes in a shell argument."""
    for t in texts:
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the text has a character that is not valid Unicode ({t[e.start]!r} at index {e.start}, "
                             "often from non-UTF-8 bytes in a command-line argument); pass UTF-8 text") from None


def encode_texts(tokenizer: "PreTrainedTokenizerBase", texts: str | Sequence[str],
                 bos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize each text once, with `bos` put first when given: right-padded ids [batch, pos] and each
    row's real length [batch]. `HookedTransformer.to_tokens` and the lenses both tokenize through this."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    check_unicode(texts)
    with tokenizer_failures(tokenizer):
        rows = [([bos] if bos is not None else []) + tokenizer.encode(t, add_special_tokens=False) for t in texts]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("an empty text has no tokens; pass prepend_bos=True or a non-empty string")
    return right_pad(rows, pad_token_id(tokenizer)), torch.tensor([len(r) for r in rows])


def single_token_id(tokenizer: "PreTrainedTokenizerBase | None", text: str) -> int:
    """The id of text that is exactly one token, or a ValueError naming its pieces."""
    if tokenizer is None:
        raise ValueError(f"reading {text!r} as a token needs the model's tokenizer; pass a token id instead")
    with tokenizer_failures(tokenizer):
        ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        pieces = [tokenizer.decode([i]) for i in ids]
        raise ValueError(f"{text!r} is {len(ids)} tokens {pieces}; pass text that is exactly one token, or an id")
    return int(ids[0])


# Escapes that make whitespace and control characters visible in tables and figures.
# Backslashes are left alone, so a partial UTF-8 byte shown as '\\xe2' (see `decode_token`) reads as such.
_SHOWN = {"\n": "\\n", "\t": "\\t", "\r": "\\r", " ": "·"}


def show_token(text: str, max_chars: int | None = None) -> str:
    """A token as a reader should see it: spaces as '·', newlines and tabs as '\\n' and '\\t', other
    control characters as '\\x..', the empty string as '∅', cut to `max_chars` with '…'.

    >>> show_token("    return")
    '····return'
    """
    shown = "".join(_SHOWN.get(ch) or (ch if unicodedata.category(ch)[0] != "C" else f"\\x{ord(ch):02x}") for ch in text)
    if shown == "":
        shown = "∅"
    if max_chars is not None and len(shown) > max_chars:
        shown = shown[: max_chars - 1] + "…"
    return shown


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:  # the unprintable bytes are moved, in order, to code points 256 and up
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_DECODER = byte_decoder()


def decode_token(tokenizer: "PreTrainedTokenizerBase", token_id: int) -> str:
    """A token's text; a token that is part of a multi-byte character shows its bytes, e.g. '\\xe2\\x80'."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str) or any(ch not in BYTE_DECODER for ch in piece):
        return text  # not a byte-level BPE token: keep the decoder's answer
    return bytes(BYTE_DECODER[ch] for ch in piece).decode("utf-8", errors="backslashreplace")


def token_texts(tokenizer: "PreTrainedTokenizerBase | None", ids: Any) -> list[str]:
    """`decode_token` of every id (each distinct id decoded once), or '<id>' when there is no tokenizer."""
    ids = [int(i) for i in torch.as_tensor(ids).reshape(-1).tolist()]
    if tokenizer is None:
        return [f"<{i}>" for i in ids]
    memo = {i: decode_token(tokenizer, i) for i in set(ids)}
    return [memo[i] for i in ids]


def check_padding_side(padding_side: str | None) -> None:
    """Only right padding: lenskit's forward takes no attention mask, and causal attention leaves a right-padded row's
    real positions exact, while left pads would be attended to and would shift every position."""
    if padding_side not in (None, "right"):
        raise ValueError(f"padding_side={padding_side!r}: lenskit pads on the right only (its forward takes no attention "
                         "mask, and right padding keeps each text's positions exact); drop padding_side or pass 'right'")


def adds_bos(tokenizer: "PreTrainedTokenizerBase") -> bool:
    """Whether the tokenizer's own encoding, special tokens on, starts a text with its BOS token."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos]


class TextMethods:
    """The model's text methods (TransformerLens's names): text to ids, ids to text. Mixed into
    `HookedTransformer`, which gives them `tokenizer`, `cfg` and `embed`. `validate_tokens` is the forward's check of its input."""

    def validate_tokens(self, tokens: "TokensLike", prepend_bos: bool | None = None,
                        padding_side: str | None = None) -> torch.Tensor:
        """Text becomes tokens (`to_tokens`); token tensors are checked for dtype, shape, vocabulary and context length."""
        if is_text(tokens):
            tokens = self.to_tokens(tokens, prepend_bos, padding_side)
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"expected a LongTensor of token ids or text, got {type(tokens).__name__}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor, got dtype {tokens.dtype}")
        if tokens.ndim == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.ndim != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must have shape [batch, pos] with pos >= 1, got {tuple(tokens.shape)}")
        if tokens.shape[0] == 0:
            raise ValueError(f"tokens hold no sequence (shape {tuple(tokens.shape)}); pass at least one, [batch >= 1, pos]")
        if tokens.shape[1] > self.cfg.n_ctx:
            raise ValueError(
                f"the prompt has {tokens.shape[1]} tokens but the model's context is n_ctx={self.cfg.n_ctx}; "
                f"truncate it (e.g. tokens[:, -{self.cfg.n_ctx}:]) or split it into windows"
            )
        return self._in_vocabulary(tokens).to(device=self.embed.weight.device)

    def _in_vocabulary(self, tokens: torch.Tensor) -> torch.Tensor:
        """Integer ids of any shape as a LongTensor, each checked to lie in [0, d_vocab)."""
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor, got dtype {tokens.dtype}")
        ids = tokens if tokens.dtype == torch.long else tokens.long()  # int8/uint8 would overflow `<`; uint16-64 lack it
        bad = (ids < 0) | (ids >= self.cfg.d_vocab)
        if bad.any():
            at = tuple(int(i) for i in bad.nonzero()[0])
            value = int(ids[at])
            if tokens.dtype == torch.uint64 and value < 0:  # an id of 2**63 or more, wrapped by .long()
                value = f"{value + 2 ** 64} (uint64)"
            where = f"[batch {at[0]}, pos {at[1]}]" if len(at) == 2 else f"index {list(at)}"
            raise ValueError(f"token id {value} at {where} is outside the vocabulary [0, {self.cfg.d_vocab})")
        return ids

    def _ids_to_read(self, tokens: Any, what: str) -> torch.Tensor:
        """Token ids [pos] or [batch, pos] for turning into text (a lone id counts as [1]), checked like a forward's."""
        try:
            ids = torch.as_tensor(tokens)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise TypeError(f"{what} takes text or token ids [pos] or [batch, pos], got {type(tokens).__name__} "
                            f"{tokens!r:.60}") from None
        if ids.ndim > 2:
            raise ValueError(f"{what} takes token ids [pos] or [batch, pos], got a tensor of shape {tuple(ids.shape)}; "
                             "pass one batch of it, e.g. tokens[0]")
        return ids.long() if ids.numel() == 0 else self._in_vocabulary(ids.reshape(-1) if ids.ndim == 0 else ids)

    def _need_tokenizer(self) -> "PreTrainedTokenizerBase":
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; pass token ids, or load from a folder with tokenizer files")
        return self.tokenizer

    def to_tokens(self, text: str | Sequence[str], prepend_bos: bool | None = None, padding_side: str | None = None,
                  move_to_device: bool = True, truncate: bool = False) -> torch.Tensor:
        """Token ids [batch, pos]. Several texts are right-padded with the EOS id; causal attention keeps
        the real positions exact, and positions past a text's end are padding.

        `prepend_bos=None` does what `cfg.default_prepend_bos` says; lenskit's default there is None, which does
        what the checkpoint's own tokenizer does: Llama 3 and Mistral tokenizers put BOS first, GPT-2, Pythia and
        Qwen ones do not. True or False overrides that, as in TransformerLens (whose default is True).
        `truncate` keeps the first n_ctx tokens (TransformerLens's default); without it a forward refuses a longer
        prompt. `padding_side` may only be "right" (see README, "Coming from TransformerLens").

        >>> model.to_tokens("Hello world")   # stdlib-gpt2's tokenizer; GPT-2's gives tensor([[15496, 995]])
        tensor([[3876, 1245, 1127]])
        """
        tok = self._need_tokenizer()
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"to_tokens needs a string or a non-empty list of strings; got no texts or non-strings: {text!r:.80}")
        check_padding_side(padding_side)
        tokens, _ = encode_texts(tok, texts, bos=self.bos_id(prepend_bos))
        if truncate:
            tokens = tokens[:, : self.cfg.n_ctx]
        return tokens.to(self.embed.weight.device) if move_to_device else tokens

    def bos_id(self, prepend_bos: bool | None = None) -> int | None:
        """The id `to_tokens` puts first, or None: `prepend_bos=None` follows `cfg.default_prepend_bos`, and where
        that is None too, the checkpoint's tokenizer."""
        tok = self._need_tokenizer()
        if prepend_bos is None:
            prepend_bos = self.cfg.default_prepend_bos
        if not isinstance(prepend_bos, (bool, type(None))):
            raise TypeError(f"prepend_bos must be True, False or None, got {prepend_bos!r}")
        if not (adds_bos(tok) if prepend_bos is None else prepend_bos):
            return None
        bos = tok.bos_token_id if tok.bos_token_id is not None else self.cfg.bos_token_id
        if bos is None:
            raise ValueError("prepend_bos=True but neither the tokenizer nor the config defines a BOS token")
        return bos

    def to_single_token(self, text: str) -> int:
        """The id of text that is exactly one token (no BOS), or a ValueError naming its pieces."""
        return single_token_id(self._need_tokenizer(), text)

    def to_str_tokens(self, tokens: torch.Tensor | str | Sequence[str], prepend_bos: bool | None = None,
                      padding_side: str | None = None) -> list[str] | list[list[str]]:
        """Each token as its text: a list for one sequence, a list of lists for a batch. Text is tokenized as
        `to_tokens(text, prepend_bos)` does; token ids are read as they are."""
        tok = self._need_tokenizer()
        if isinstance(tokens, str):
            tokens = self.to_tokens(tokens, prepend_bos, padding_side)
        elif is_text(tokens):
            return [self.to_str_tokens(t, prepend_bos, padding_side) for t in tokens]
        ids = self._ids_to_read(tokens, "to_str_tokens")
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim == 2:
            return [[tok.decode([t]) for t in row] for row in ids.tolist()]
        return [tok.decode([t]) for t in ids.tolist()]

    def to_string(self, tokens: torch.Tensor) -> str | list[str]:
        """The text of token ids: one string for [pos], a list of strings for [batch, pos]."""
        tok = self._need_tokenizer()
        ids = self._ids_to_read(tokens, "to_string")
        if ids.ndim == 2:
            return [tok.decode(row) for row in ids.tolist()]
        return tok.decode(ids.tolist())

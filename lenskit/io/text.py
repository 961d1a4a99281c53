"""Text and tokens in one place: is this text?, text to padded token ids with each row's length, one-token
text to its id, a token shown as a reader should see it (`show_token`, `decode_token`), and the checks of token ids
that the model's own text methods (`HookedTransformer.to_tokens`, `to_str_tokens`, `to_string`, ...) run."""

from __future__ import annotations

import unicodedata
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .tokenizer import tokenizer_failures

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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


def check_vocabulary(tokens: torch.Tensor, d_vocab: int) -> torch.Tensor:
    """Integer ids of any shape as a LongTensor, each checked to lie in [0, d_vocab)."""
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"token ids must be an integer tensor, got dtype {tokens.dtype}")
    ids = tokens if tokens.dtype == torch.long else tokens.long()  # int8/uint8 would overflow `<`; uint16-64 lack it
    bad = (ids < 0) | (ids >= d_vocab)
    if bad.any():
        at = tuple(int(i) for i in bad.nonzero()[0])
        value = int(ids[at])
        if tokens.dtype == torch.uint64 and value < 0:  # an id of 2**63 or more, wrapped by .long()
            value = f"{value + 2 ** 64} (uint64)"
        where = f"[batch {at[0]}, pos {at[1]}]" if len(at) == 2 else f"index {list(at)}"
        raise ValueError(f"token id {value} at {where} is outside the vocabulary [0, {d_vocab})")
    return ids

"""Patchscopes (Ghandeharioun et al., 2024): decode a hidden state by patching it into a target prompt and
reading what the model predicts next.

A row h of source stream s is written over the target prompt's stream at the placeholder's position (in
the same stream s, or in a fixed `target_layer`), the model runs on, and the lens's logits are the model's
next-token logits at the target prompt's last position. The default target prompt is the few-shot identity
prompt of the paper, which asks the model to repeat the token the patched state stands for.

At the last stream (s = n_layers) with the placeholder last, nothing runs after the patch and the
patchscope is exactly the logit lens: the final norm and unembedding read h itself.
"""

from __future__ import annotations

from typing import Iterator

import torch

from lenskit import HookedTransformer, Stream
from lenskit.observe.hooks import HookPoint, layer_of
from lenskit.observe.stream import as_stream

from .base import Lens

DEFAULT_TARGET_PROMPT = "cat -> cat\n1135 -> 1135\nhello -> hello\n?"
# Points a row can be patched into: the stream between blocks and the middle of a block. A sublayer's write
# (attn_out, mlp_out) is a part of the stream, not a stream, so a patchscope does not read it.
PATCHABLE = ("resid_pre", "resid_mid")
# Rows x target-prompt tokens run in one forward, so that the activations of a chunk stay bounded
# (4096 tokens: the batch of one 4 x 1024 forward) however many rows a caller passes.
CHUNK_TOKENS = 2**12


class Patchscope(Lens):
    """`lens(h, s)`: each row of h [..., d_model], from stream s, patched into the target prompt at its
    placeholder, and the model's next-token logits [..., d_vocab] (float32) at the prompt's last position.

    - `target_prompt`: text, tokenized as `model.to_tokens` tokenizes it (BOS as the checkpoint's tokenizer
      puts it), or token ids [pos].
    - `target_layer`: None patches the same stream as the source (`s`); an int l (or a `Stream`, e.g.
      `Stream(2, "resid_mid")`) patches that stream for every source.
    - `placeholder`: the text whose token(s) mark the patched position: the last occurrence of its token ids
      in the prompt's, and of a several-token placeholder its last token. `position` gives the token index
      instead (negative counts back from the end); pass it where the placeholder alone tokenizes otherwise
      than inside the prompt (a SentencePiece tokenizer may prefix "▁" to it), which is refused as missing.

    Streams: `resid_pre` 0..n_layers (`resid_post` l is stream l + 1) and `resid_mid`. Rows run together:
    the target prompt's stream before the patched block is the same for every row, so it is computed once,
    expanded to [rows, pos, d_model], and only the blocks from the patched one on run per row,
    `CHUNK_TOKENS` tokens at a time. The patch is a hook (`model.hooks`), removed after each chunk, also
    when anything raises.

    >>> ps = Patchscope(model)                                    # the identity prompt, placeholder "?"
    >>> _, cache = model.run_with_cache("import os\\nos.path.")
    >>> ps(cache.stream(3)[0, -1], 3).shape                       # what stream 3 at the last token stands for
    torch.Size([4096])
    >>> ps2 = Patchscope(model, "The capital of X is", placeholder=" X", target_layer=2)   # any source -> stream 2
    >>> ps2.position                                              # the placeholder's token
    5
    """

    name = "patchscope"

    def __init__(self, model: HookedTransformer, target_prompt: str | torch.Tensor = DEFAULT_TARGET_PROMPT, *,
                 target_layer: int | str | Stream | None = None, placeholder: str | None = "?",
                 position: int | None = None) -> None:
        super().__init__(model)
        if not isinstance(target_prompt, (str, torch.Tensor)):
            raise TypeError(f"target_prompt must be text or token ids [pos], got {type(target_prompt).__name__}")
        tokens = model.validate_tokens(target_prompt)  # [1, pos]: text as model.to_tokens tokenizes it
        if tokens.shape[0] != 1:
            raise ValueError(f"target_prompt must be one prompt, token ids [pos] or [1, pos]; got shape {tuple(tokens.shape)}")
        self.target_prompt = target_prompt
        self.target_tokens = tokens[0].cpu()  # [pos]
        self._device_tokens: torch.Tensor | None = None  # a copy where the model runs (`_tokens_on`)
        self.placeholder = placeholder if position is None else None
        self.position = (self._placeholder_position(placeholder) if position is None
                         else self._checked_position(position))
        self.target_layer = None if target_layer is None else self._patchable(as_stream(target_layer), "target_layer")
        self.chunk_rows = max(1, CHUNK_TOKENS // len(self.target_tokens))  # rows per forward

    # ------------------------------------------------------------ the prompt
    def _placeholder_position(self, placeholder: str | None) -> int:
        tokens = self.target_tokens.tolist()
        if not placeholder:
            raise ValueError("a patchscope needs a non-empty placeholder in its target prompt, or position=<token index>")
        if self.model.tokenizer is None:
            raise ValueError("finding the placeholder needs the model's tokenizer; pass position=<token index> instead")
        ids = self.model.tokenizer.encode(placeholder, add_special_tokens=False)
        k = len(ids)
        for start in range(len(tokens) - k, -1, -1):  # the last occurrence
            if tokens[start: start + k] == ids:
                return start + k - 1
        raise ValueError(f"the target prompt's {len(tokens)} tokens {self._pieces()} do not contain the placeholder "
                         f"{placeholder!r} (token ids {ids}); put it in the prompt, or pass position=<token index>")

    def _checked_position(self, position: int) -> int:
        T = len(self.target_tokens)
        if isinstance(position, bool) or not isinstance(position, int):
            raise TypeError(f"position must be an int token index, got {type(position).__name__} {position!r}")
        if not -T <= position < T:
            raise ValueError(f"position={position} is outside the target prompt's {T} tokens; pass an index in "
                             f"0..{T - 1} (or -{T}..-1, counting back)")
        return position % T

    def _pieces(self) -> list[str]:
        tok = self.model.tokenizer
        return [tok.decode([t]) for t in self.target_tokens.tolist()] if tok is not None else self.target_tokens.tolist()

    # ------------------------------------------------------------ streams
    def _patchable(self, s: Stream, what: str) -> Stream:
        s = s.resolve(self.n_layers).canonical()
        if s.point not in PATCHABLE:
            raise ValueError(f"a patchscope patches residual streams (resid_pre 0..{self.n_layers}, resid_mid, "
                             f"resid_post), not {what} {s}, a sublayer's write; read that with LogitLens")
        return s

    def target(self, s: int | str | Stream) -> Stream:
        """The stream that a row of source stream `s` is patched into: `s` itself, or `target_layer`."""
        source = self._patchable(as_stream(s), "the source stream")
        return source if self.target_layer is None else self.target_layer

    def covers(self, s: Stream) -> bool:
        return s.canonical().point in PATCHABLE

    def reads_as_model(self, s: Stream) -> bool:
        # The identity: patched into the last stream at the last position, h itself is read out.
        return (self.covers(s) and self.target(s) == Stream(self.n_layers)
                and self.position == len(self.target_tokens) - 1)

    # ------------------------------------------------------------ decoding
    def forward(self, h: torch.Tensor, s: int | str | Stream) -> torch.Tensor:
        self.check_hidden(h)
        rows = h.reshape(-1, h.shape[-1])
        logits = [self.model.readout.logits(x) for _, x in self._final_streams(rows, s)]
        if not logits:  # no rows
            return torch.empty(*h.shape[:-1], self.model.readout.d_vocab, device=h.device)
        return torch.cat(logits).view(*h.shape[:-1], -1)

    def logits_into(self, h: torch.Tensor, s: Stream, out: torch.Tensor) -> torch.Tensor:
        self.check_hidden(h)
        for rows, x in self._final_streams(h, s):
            self.model.readout.into(x, out[rows])
        return out

    def _final_streams(self, h: torch.Tensor, s: int | str | Stream) -> Iterator[tuple[slice, torch.Tensor]]:
        """For rows h [rows, d_model], chunk by chunk: (the chunk's rows, the last stream at the target prompt's
        last position [chunk, d_model]) of the target prompt run with each row patched in."""
        model, n = self.model, self.n_layers
        hook_name = self.target(s).hook_name(n)
        first = layer_of(hook_name)  # the block the patch happens in; it and the blocks after it run per row
        weight = model.embed.weight
        h = h.to(device=weight.device, dtype=weight.dtype)
        # Before that block the prompt's stream is the same for every row: it is computed once, for one row.
        clean = model(self._tokens_on(weight.device)[None], stop_at_layer=first)  # [1, pos, d_model]
        for start in range(0, len(h), self.chunk_rows):
            chunk = h[start: start + self.chunk_rows]
            x = clean.expand(len(chunk), -1, -1).clone()  # [chunk, pos, d_model], a real tensor: hooks may write into it
            with model.hooks([(hook_name, _Patch(chunk, self.position))]):
                x = model.run_blocks(x, first)  # [chunk, pos, d_model]
            yield slice(start, start + len(chunk)), x[:, -1]

    def _tokens_on(self, device: torch.device) -> torch.Tensor:
        """The target prompt's ids on `device`, copied there once: evaluation calls the lens per chunk and stream,
        and a host-to-device copy in that loop would wait for the device each time."""
        if self._device_tokens is None or self._device_tokens.device != device:
            self._device_tokens = self.target_tokens.to(device)
        return self._device_tokens

    def extra_repr(self) -> str:
        T = len(self.target_tokens)
        at = f"position={self.position} of {T} tokens"
        if self.placeholder is not None:
            at += f" (placeholder {self.placeholder!r})"
        target = "the source stream" if self.target_layer is None else str(self.target_layer)
        return f"target_prompt={self.target_prompt!r}, {at}, target={target}"


class _Patch:
    """A hook that writes one row of `rows` [rows, d_model] over each row of the stream at `position`."""

    def __init__(self, rows: torch.Tensor, position: int) -> None:
        self.rows, self.position = rows, position

    def __call__(self, x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        x = x.clone()  # [rows, pos, d_model]; a copy, so autograd still has the clean stream it saved
        x[:, self.position] = self.rows
        return x

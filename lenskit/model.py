"""HookedTransformer: a decoder-only transformer of any family lenskit reads (the list is `lenskit.families.FAMILIES`)
whose every write to the residual stream passes a named hook point.

The class reads top to bottom: construction, the forward, running with hooks, a cache or SAEs, text and tokens,
TransformerLens's hook-point switches, the weight views, TransformerLens's small conveniences, generation, and
loading and saving. Long helpers live beside it as free functions it calls (generation's loop in
lenskit.generation, the checkpoint conversion in lenskit.io.loading, weight processing in lenskit.processing,
the switches' block surgery in lenskit.observe.switches, the conveniences in lenskit.conveniences); none of them
imports this module, so the model is built from its parts, never the other way round. The hook administration
(`hooks`, `add_hook`, `reset_hooks` ...) is `HookedRootModule`'s (lenskit.observe.hooks)."""

from __future__ import annotations

import copy
import math
import os
import warnings
from functools import partial
from typing import TYPE_CHECKING, Any, ContextManager, Iterable, Iterator, Sequence, Union

import torch
from torch import nn

from . import conveniences
from .config import ModelConfig
from .config_names import note_placement, note_switch
from .devices import parse_device
from .generation import generate
from .io import loading
from .io.text import adds_bos, check_padding_side, check_vocabulary, encode_texts, is_text, single_token_id
from .kv_cache import KVCache, extending, start_position
from .losses import next_token_loss
from .observe.backward import backward_from, check_gradients_possible
from .observe.cache import ActivationCache
from .observe.hook_context import positions_from
from .observe.hooks import CacheRecording, HookedRootModule, HookFn, HookPoint, NameOrPredicate, NamesFilter, layer_of
from .observe.switches import switch, switched_name_error
from .pieces.embeddings import Embed, PosEmbed, Unembed
from .pieces.forward_state import ForwardState
from .pieces.layers import make_block, make_norm
from .pieces.mlp import XIELU
from .pieces.per_layer import PerLayerInputs, side_inputs
from .pieces.readout import Readout
from .pieces.weights import ov_circuit, qk_circuit, stacked_view, tl_parameters
from .placement import Placement
from .processing import process_weights
from .saes.splice import spliced

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TokensLike = Union[torch.Tensor, str, Sequence[str]]


class HookedTransformer(HookedRootModule):
    """A transformer with TransformerLens-style hook points, numerically equal to `transformers`' own
    class for its family. Positions are learned (`pos_embed`, `hook_pos_embed`) or rotary (inside
    attention); the choice is made once, here.

    >>> model = HookedTransformer.from_pretrained(lenskit.DEFAULT_MODEL)
    >>> logits, cache = model.run_with_cache("def __init__(self")
    >>> cache["resid_post", 3].shape   # [batch, pos, d_model]
    torch.Size([1, 5, 192])
    """

    ON_REQUEST = ("attn.hook_result", "mlp.hook_expert_out", "attn.hook_state", "mamba.hook_state")
    cfg: ModelConfig  # declared here too: the mixins' `cfg: object` would otherwise be its type for mypy
    # The files from_pretrained left the weights memory-mapped from (lenskit.io.mapped), checked before each forward.
    weight_files = None
    # Where each block computes (lenskit.placement); None: all on the weights' one device, as `.to()` put them.
    placement: Placement | None = None
    # The weight processing applied (lenskit.processing), in order: () for the raw weights.
    processing: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig, tokenizer: "PreTrainedTokenizerBase | None" = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.cfg = copy.copy(cfg)  # this model's own: it records where the model is (`cfg.device`, `cfg.dtype`)
        self.tokenizer = tokenizer
        self.embed = Embed(cfg.d_vocab, cfg.d_model)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        if cfg.positional == "learned":
            self.pos_embed = PosEmbed(cfg.n_ctx, cfg.d_model)
            self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        self._stream_start = self._embed_learned if cfg.positional == "learned" else self._embed_tokens
        self._embed_scale = (_embed_scaled if cfg.scale_embed else _embed_as_is if cfg.scales.embedding == 1.0
                             else partial(_embed_times, cfg.scales.embedding))
        self.dropout = nn.Dropout(dropout)
        if cfg.block.d_per_layer is not None:  # Gemma 4 E2B/E4B: an input per block, from the tokens (lenskit.pieces.per_layer)
            self.per_layer_inputs = PerLayerInputs(cfg)
        self._side_inputs = side_inputs(self, cfg)  # chosen once: what the blocks read beside the stream, if anything
        self.blocks = nn.ModuleList(make_block(cfg, dropout, i) for i in range(cfg.n_layers))
        self.ln_final = make_norm(cfg)
        self.unembed = Unembed(cfg.d_model, cfg.d_vocab, bias=False, scale=cfg.scales.logits)
        # Not a submodule: it holds ln_final and unembed themselves, so state dicts and hook names are unchanged.
        self.readout = Readout(self.ln_final, self.unembed, cfg.final_softcap)
        self.tie_weights()
        self.setup_hooks()
        self.init_weights()
        note_placement(self.cfg, self.embed.weight)

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)  # .to(), .cuda(), .half() ... all come through here
        note_placement(self.cfg, self.embed.weight)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)  # assign=True replaces the tensors
        note_placement(self.cfg, self.embed.weight)
        return out

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.unembed.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self, residual_scaling: bool = True) -> None:
        """GPT-2's init: N(0, 0.02) weights, zero biases, unit norm gains.

        With `residual_scaling`, the two projections that write into the stream in each block
        (`attn.out`, `mlp.fc_out`) get std 0.02 / sqrt(2 * n_layers), so the stream's variance
        stays level with depth instead of growing with the number of writes.
        """
        if self.embed.weight.is_meta:
            return
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("ln_final") or "_norm." in name or name.endswith(
                    ("router.scale", "router.per_expert_scale")):  # Gemma 4's router gains too
                nn.init.ones_(p)  # Gemma's (1 + w) norms are reset to their own identity below
            elif residual_scaling and name.endswith(("attn.out.weight", "mlp.fc_out.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, 0.0, std)
        for module in self.modules():
            if getattr(module, "IDENTITY_WEIGHT", 1.0) != 1.0:
                nn.init.constant_(module.weight, module.IDENTITY_WEIGHT)
            if isinstance(module, XIELU):  # its scalars start where transformers' do, not at N(0, std)
                module.reset_parameters()

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: TokensLike, return_type: str | None = "logits", *, stop_at_layer: int | None = None,
                prepend_bos: bool | None = None, padding_side: str | None = None,
                loss_per_token: bool = False,
                past_kv_cache: KVCache | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """Logits [batch, pos, d_vocab] at every position; with `stop_at_layer=l`, the stream after l blocks.

        `return_type` as in TransformerLens: "logits", "loss" (mean next-token cross-entropy over every
        position but the last, nats), "both" (logits, loss) or None (run for the hooks, return nothing).
        The loss counts every position, so for right-padded texts pass equal-length token windows instead.
        `prepend_bos` and `padding_side` apply to text input, as in `to_tokens`. `loss_per_token` makes the
        loss each prediction's [batch, pos - 1] (`lenskit.losses.next_token_loss`).
        With `past_kv_cache` (lenskit.kv_cache.KVCache) the tokens continue the cached ones: positions start at its
        n_pos, the blocks attend to the cached keys too, and the cache grows by the tokens' length.
        """
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")
        n = self.cfg.n_layers
        if stop_at_layer is not None and not (isinstance(stop_at_layer, int) and not isinstance(stop_at_layer, bool)
                                              and -n <= stop_at_layer <= n):
            raise ValueError(f"stop_at_layer must be an int in [-{n}, {n}] (streams after 0..{n} blocks), got {stop_at_layer!r}")
        if self.weight_files is not None:
            self.weight_files.check()  # a mapped weights file written in place since load: refuse, do not compute
        tokens = self.validate_tokens(tokens, prepend_bos, padding_side)
        start = start_position(past_kv_cache, self, tokens, stop_at_layer)  # 0 without a cache
        x = self.dropout(self._stream_start(tokens, start))  # [batch, pos, d_model]
        # What the blocks read beside the stream, handed down as an argument: the cache, Gemma 4's per-layer inputs.
        state = ForwardState(start, past_kv_cache, self._side_inputs(tokens, x))
        # The cache is put back on failure; hooks that name positions read where these tokens start.
        with extending(past_kv_cache, tokens.shape[1]), positions_from(None if past_kv_cache is None else start):
            x = self.run_blocks(x, 0, stop_at_layer, state)
        if stop_at_layer is not None:
            return x
        logits = self.readout(x)  # [batch, pos, d_vocab]
        if return_type == "logits" or return_type is None:
            return logits if return_type else None
        loss = next_token_loss(logits, tokens, per_token=loss_per_token)  # loss_per_token: [batch, pos - 1]
        return loss if return_type == "loss" else (logits, loss)

    def run_blocks(self, x: torch.Tensor, start: int = 0, stop: int | None = None,
                   state: ForwardState | None = None) -> torch.Tensor:
        """The stream [batch, pos, d_model] after blocks[start:stop], each on its device (`placement`). `state` is
        the forward's (lenskit.pieces.forward_state); without one (resuming from a stream) no cache is used, and a
        block that needs the forward's own inputs (Gemma 4's per-layer inputs or shared keys) is refused."""
        if self.placement is None:
            for block in self.blocks[start:stop]:
                x = block(x, state)  # [batch, pos, d_model]
            return x
        for layer in range(*slice(start, stop).indices(len(self.blocks))):
            x = self.placement.run(layer, self.blocks[layer], x, state)  # [batch, pos, d_model], on block layer's device
        return x

    def _embed_learned(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return self.hook_embed(self.embed(tokens)) + self.hook_pos_embed(self.pos_embed(positions).expand(tokens.shape[0], -1, -1))

    def _embed_tokens(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        # rotary families: positions enter inside attention. hook_embed sees the embedding as written, after any scale.
        return self.hook_embed(self._embed_scale(self.embed(tokens)))

    def readout_uncapped(self, h: torch.Tensor) -> torch.Tensor:
        """`model.readout.uncapped(h)`: the logits before any final soft-cap, which attribution splits into parts."""
        return self.readout.uncapped(h)

    # ------------------------------------------------------------- running: hooks, a cache, SAEs
    def run_with_hooks(self, tokens: TokensLike, fwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]] = (),
                       bwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]] = (), *, reset_hooks_end: bool = True,
                       clear_contexts: bool = False, **kwargs: Any) -> torch.Tensor:
        """Run with hooks attached for this call only; they are removed even if the call raises.

        Backward hooks removed on return never see a gradient, so `bwd_hooks` need `reset_hooks_end=False`, as in
        TransformerLens: then all the hooks are attached globally and stay until `reset_hooks()`. Within one thread,
        `with model.hooks(fwd_hooks, bwd_hooks): model(tokens, return_type="loss").backward()` is the temporary form.
        """
        if not reset_hooks_end:
            for dir, pairs in (("fwd", list(fwd_hooks)), ("bwd", list(bwd_hooks))):
                self._pairs(pairs, f"{dir}_hooks")  # refuse a bad pair before attaching any
                for target, fn in pairs:
                    self.add_hook(target, fn, dir=dir)
            return self(tokens, **kwargs)
        bwd_hooks = list(bwd_hooks)
        if bwd_hooks:
            warnings.warn("run_with_hooks removes its hooks when it returns, before any backward pass can run, so "
                          "bwd_hooks will not be called; pass reset_hooks_end=False (and call reset_hooks() after), "
                          "or call .backward() inside `with model.hooks(fwd_hooks, bwd_hooks):`", stacklevel=2)
        with self.hooks(fwd_hooks, bwd_hooks, clear_contexts=clear_contexts):
            return self(tokens, **kwargs)

    def saes(self, saes: Sequence[Any], use_error_term: bool = True) -> ContextManager[Any]:
        """Splice SAEs (lenskit.saes.SAE) in for the body of a `with` block; removed on exit, also when it raises.

        With `use_error_term` (the default) each hook gets reconstruction + error, so outputs are unchanged to
        rounding while the SAE's own hook points (`f"{hook}.hook_sae_acts_post"`, ...) are in `hook_dict`, cached
        and hookable; without it the activation is replaced by the reconstruction. See lenskit.saes.splice.
        """
        return spliced(self, saes, use_error_term)

    def run_with_saes(self, tokens: TokensLike, saes: Sequence[Any] = (), *, use_error_term: bool = True,
                      **kwargs: Any) -> torch.Tensor:
        """Run once with `saes` spliced in (`model.saes`); `use_error_term=False` runs on the reconstructions."""
        with self.saes(saes, use_error_term=use_error_term):
            return self(tokens, **kwargs)

    def run_with_cache(
        self,
        tokens: TokensLike,
        names_filter: NamesFilter = None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        fwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]] = (),
        return_logits: bool = True,
        cache_device: str | torch.device | None = None,
        incl_bwd: bool = False,
        remove_batch_dim: bool = False,
        return_cache_object: bool = True,
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor | None, ActivationCache | dict[str, torch.Tensor]]:
        """Run once and keep the activations `names_filter` selects (see `hook_names`).

        Cached tensors are stored as produced, without copies, unless `device` or `dtype` asks for one.
        `cache_device="cpu"` (or `device`, TransformerLens's name for it) offloads: each tensor leaves the
        accelerator as it is written, through pinned memory without waiting, with one wait at the end, so a
        long cache needs no accelerator memory. On the CPU it is the plain cache.
        `fwd_hooks` run before caching, so the cache sees their edits. An edit in place never reaches an
        entry cached at an earlier point (`resid_post` of block l is the same tensor as `resid_pre` of block
        l + 1): a hook handed a tensor the cache already holds gets a copy (see `CacheRecording`).

        With `return_logits=False` the run stops after the last block that a cached name or a `fwd_hooks`
        target lives in, skipping the unembedding, and returns `(None, cache)`:

        >>> _, cache = model.run_with_cache(tokens, ["blocks.2.hook_resid_post"], return_logits=False)  # 3 blocks run

        `incl_bwd=True` does as TransformerLens does: it calls `.backward()` on the output, which must then be a
        scalar (`return_type="loss"`), and caches the gradient reaching each cached point under `<name>_grad`.
        Parameter gradients accumulate into `.grad` as in any backward pass.

        `remove_batch_dim=True` drops the batch axis of a one-sequence run's cache (`cache.remove_batch_dim()`); the
        logits keep theirs, as in TransformerLens. `return_cache_object=False` returns the plain dict of tensors
        (`cache.cache_dict`) instead of the cache. `clear_contexts=True` empties every hook point's `ctx` at the end.
        `reset_hooks_end` (TransformerLens's) may only be True: the caching hooks are always removed on return.
        """
        if reset_hooks_end is not True:
            raise ValueError("run_with_cache always removes its hooks on return (reset_hooks_end=True); for gradients "
                             "at the cached points pass incl_bwd=True, or attach hooks with model.add_hook")
        if incl_bwd:
            check_gradients_possible("run_with_cache(incl_bwd=True)")
        if incl_bwd and not return_logits:
            raise ValueError("incl_bwd=True differentiates the model's output, so the run cannot stop early; "
                             "drop return_logits=False")
        if cache_device is not None and device is not None and torch.device(cache_device) != torch.device(device):
            raise ValueError(f"device={device!r} and cache_device={cache_device!r} both say where the cache goes; pass one")
        where = cache_device if cache_device is not None else device
        if where is not None:  # an impossible device refused in one line, before the run
            parse_device(where, "cache_device" if cache_device is not None else "device")
        recording = CacheRecording(where, dtype)
        names = self.hook_names(names_filter)
        fwd_hooks = list(fwd_hooks)
        stop = kwargs.get("stop_at_layer")
        if not return_logits:
            if stop is not None:
                raise ValueError("pass return_logits=False or stop_at_layer, not both: return_logits=False "
                                 "already stops after the last block that the cache or fwd_hooks need")
            targets = [n for item in fwd_hooks if isinstance(item, (tuple, list)) for n in self._names_of(item[0])]
            kwargs["stop_at_layer"] = self._blocks_needed([*names, *targets])
        elif isinstance(stop, int) and isinstance(names_filter, (str, list, tuple)):
            # Names asked for one by one must all arrive; a predicate takes what the shortened run has.
            stop = stop if stop >= 0 else self.cfg.n_layers + stop
            late = [n for n in names if (need := self._blocks_needed([n])) is None or need > stop]
            if late:
                raise ValueError(f"stop_at_layer={kwargs['stop_at_layer']} ends the run before {late[:3]} fire; "
                                 "drop those names, raise stop_at_layer, or use return_logits=False")
        grads = CacheRecording(cache_device if cache_device is not None else device, dtype)
        bwd_hooks = [(name, grads.hook) for name in names] if incl_bwd else []
        try:
            with self.hooks([*fwd_hooks, *((name, recording.hook) for name in names)], bwd_hooks):
                with recording.recording():
                    out = self(tokens, **kwargs)
                if incl_bwd:
                    backward_from(out, " (return_type='loss', outside torch.no_grad())")
        finally:
            recording.synchronise()  # offloaded entries hold their values from here on
            grads.synchronise()
            if clear_contexts:
                self.clear_contexts()
        recording.check_unchanged()
        store = {**recording.store, **{f"{name}_grad": g for name, g in grads.store.items()}}
        cache = ActivationCache(store, self.cfg.n_layers, self)
        cache = cache.remove_batch_dim() if remove_batch_dim else cache
        return (out if return_logits else None), (cache if return_cache_object else cache.cache_dict)

    def _unknown(self, name: str) -> KeyError:
        """An unknown hook name, said precisely: one that a block's kind of token mixer lacks (a linear-attention
        block's `attn.hook_pattern`) names the block's kind; one that a switch adds names the switch."""
        layer = layer_of(name)
        if layer is not None and layer < len(self.blocks):
            attn = self.blocks[layer].attn
            if name.removeprefix(f"blocks.{layer}.attn.") in getattr(attn, "NO_HOOKS", ()):
                own = [f"attn.{n}" for n, m in attn.named_modules() if n and isinstance(m, HookPoint)]
                return KeyError(f"{name}: block {layer} is a {attn.LAYER_TYPE} layer, which has no attention scores, "
                                f"pattern, rotary or per-head results; use its own hooks ({', '.join(own) or 'none'}), "
                                f"or a block whose layer type is 'full' ({self.cfg.layer_types})")
        return switched_name_error(name) or super()._unknown(name)

    def _names_of(self, target: NameOrPredicate) -> list[str]:
        if isinstance(target, str):
            return [target]
        return [n for n in self.hook_dict if target(n)] if callable(target) else []

    def _blocks_needed(self, names: Iterable[str]) -> int | None:
        """How many blocks must run for every hook in `names` to fire; None when one is past the blocks."""
        needed = 0
        for name in names:
            layer = layer_of(name)
            if layer is None and name not in ("hook_embed", "hook_pos_embed"):
                return None  # ln_final and anything else after the blocks: the whole model runs
            needed = max(needed, 0 if layer is None else layer + 1)
        return needed

    # ------------------------------------------------------------- text and tokens (TransformerLens's names)
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
        return check_vocabulary(tokens, self.cfg.d_vocab)

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

    # ------------------------------------------------------------- TransformerLens's hook-point switches
    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Cache each head's write `blocks.L.attn.hook_result` [batch, pos, head, d_model] by default (True) or only
        when asked by name (False, the default). Either way the model computes the same function."""
        on_request = tuple(type(self).ON_REQUEST)
        if not isinstance(use_attn_result, bool):
            raise TypeError(f"set_use_attn_result takes True or False, got {use_attn_result!r}")
        self.ON_REQUEST = tuple(n for n in on_request if n != "attn.hook_result") if use_attn_result else on_request
        note_switch(self.cfg, "use_attn_result", use_attn_result)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Give each head its own copy of the block's input for its query, key and value: `blocks.L.hook_q_input`
        [batch, pos, head, d_model], `hook_k_input` and `hook_v_input` [batch, pos, kv_head, d_model]
        (lenskit.observe.switches)."""
        switch(self, "split_qkv", use_split_qkv_input)

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """Give each head one copy of the block's input, read by its query, key and value: `blocks.L.hook_attn_in`
        [batch, pos, head, d_model]."""
        switch(self, "attn_in", use_attn_in)

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Name the MLP's input before ln2, `blocks.L.hook_mlp_in` [batch, pos, d_model] (a copy of the stream)."""
        switch(self, "mlp_in", use_hook_mlp_in)

    # ------------------------------------------------------------- TransformerLens's weight views (lenskit.pieces.weights)
    @property
    def W_E(self) -> torch.Tensor:
        """Token embedding [d_vocab, d_model] (the parameter itself)."""
        return self.embed.weight

    @property
    def W_pos(self) -> torch.Tensor:
        """Learned position embedding [n_ctx, d_model]; rotary families have none."""
        return self.pos_embed.weight  # an AttributeError for rotary families, which have no pos_embed

    @property
    def W_U(self) -> torch.Tensor:
        """Unembedding [d_model, d_vocab] (a transposed view of the parameter; times the logits' scale where the
        readout has one, `cfg.scales.logits`, a copy then)."""
        return self.unembed.W_U

    @property
    def b_U(self) -> torch.Tensor:
        """Unembedding bias [d_vocab]: zeros, since no supported family has one, unless `fold_ln` folded a
        LayerNorm's bias into it (lenskit.processing)."""
        return self.unembed.b_U

    @property
    def W_E_pos(self) -> torch.Tensor:
        """[W_E; W_pos], [d_vocab + n_ctx, d_model]: every token and every position as one input basis (learned
        positions only; rotary families have no W_pos)."""
        if self.cfg.positional != "learned":  # a ValueError: nn.Module would replace an AttributeError's message
            raise ValueError(f"W_E_pos needs learned positions; {self.cfg.family} models are "
                             f"{self.cfg.positional}, with no W_pos")
        return torch.cat([self.W_E, self.W_pos], dim=0)

    # Each block's attention and MLP own their views (they know whether their projections are fused); stacked here.
    W_Q = stacked_view("attn", "W_Q", "[layer, head, d_model, d_head]")
    W_K = stacked_view("attn", "W_K", "[layer, head, d_model, d_head], kv heads repeated")
    W_V = stacked_view("attn", "W_V", "[layer, head, d_model, d_head], kv heads repeated")
    W_O = stacked_view("attn", "W_O", "[layer, head, d_head, d_model]: head h's slice of the output projection")
    b_Q = stacked_view("attn", "b_Q", "[layer, head, d_head]")
    b_K = stacked_view("attn", "b_K", "[layer, head, d_head], kv heads repeated")
    b_V = stacked_view("attn", "b_V", "[layer, head, d_head], kv heads repeated")
    b_O = stacked_view("attn", "b_O", "[layer, d_model]")
    W_in = stacked_view("mlp", "W_in", "[layer, d_model, d_mlp]; for a gated MLP, the linear (ungated) input, as in TransformerLens")
    W_gate = stacked_view("mlp", "W_gate", "[layer, d_model, d_mlp]: the gate of a gated MLP; None for a GELU MLP")
    W_out = stacked_view("mlp", "W_out", "[layer, d_mlp, d_model]")
    b_in = stacked_view("mlp", "b_in", "[layer, d_mlp]")
    b_gate = stacked_view("mlp", "b_gate", "[layer, d_mlp]: the gate's bias; None for a GELU MLP")
    b_out = stacked_view("mlp", "b_out", "[layer, d_model]")
    OV = property(ov_circuit, doc="[layer, head, d_model, d_model]: each head's OV circuit, factored")
    QK = property(qk_circuit, doc="[layer, head, d_model, d_model]: each head's QK circuit, factored")

    def tl_parameters(self) -> dict[str, torch.Tensor]:
        """The weight views under the names TransformerLens's `HookedTransformer` gives its parameters, e.g.
        `blocks.0.attn.W_Q` [head, d_model, d_head], `blocks.0.ln1.w` [d_model], `unembed.W_U` [d_model, d_vocab]
        (lenskit.pieces.weights.tl_parameters)."""
        return tl_parameters(self)

    def tl_named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`tl_parameters()` as (name, tensor) pairs, in the same order."""
        return iter(self.tl_parameters().items())

    # ------------------------------------------------------------- TransformerLens's conveniences (lenskit.conveniences)
    def get_token_position(self, single_token: str | int | torch.Tensor, input: str | torch.Tensor, mode: str = "first",
                           prepend_bos: bool | None = None, padding_side: str | None = None) -> int:
        """The position of `single_token` (text of one token, or an id) in `input` (text or ids [pos] or [1, pos]);
        `mode` "first" or "last". See `lenskit.conveniences.get_token_position`."""
        return conveniences.get_token_position(self, single_token, input, mode, prepend_bos, padding_side)

    def tokens_to_residual_directions(self, tokens: str | int | torch.Tensor) -> torch.Tensor:
        """`W_U[:, token]`, the stream direction each token's logit reads: [d_model] for one token, [..., d_model]
        for ids [...]. See `lenskit.conveniences.tokens_to_residual_directions`."""
        return conveniences.tokens_to_residual_directions(self, tokens)

    def loss_fn(self, logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                per_token: bool = False) -> torch.Tensor:
        """Next-token cross-entropy of logits [batch, pos, d_vocab] against tokens [batch, pos]: a scalar, or
        [batch, pos - 1] with `per_token` (`lenskit.losses.next_token_loss`, which documents `attention_mask`)."""
        return next_token_loss(logits, tokens, attention_mask, per_token)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> torch.Tensor:
        """The sum [d_model] of the output biases blocks 0 .. layer - 1 add to the stream (with `mlp_input`, block
        `layer`'s `attn.b_O` too). See `lenskit.conveniences.accumulated_bias`."""
        return conveniences.accumulated_bias(self, layer, mlp_input, include_mlp_biases)

    def all_head_labels(self) -> list[str]:
        """"L{layer}H{head}" for every attention head, layer by layer: n_layers * n_heads labels."""
        return conveniences.all_head_labels(self.cfg.n_layers, self.cfg.n_heads)

    def to_single_str_token(self, int_token: int) -> str:
        """The text of the token with id `int_token`."""
        if isinstance(int_token, bool) or not isinstance(int_token, int):
            raise TypeError(f"to_single_str_token takes an int token id, got {type(int_token).__name__} {int_token!r:.40}")
        return self.to_str_tokens(torch.tensor([int_token]))[0]

    # ------------------------------------------------------------- generation (lenskit.generation)
    generate = generate  # greedy, or sampled with a seedable generator

    # ------------------------------------------------------------- loading and saving (lenskit.io.loading)
    @classmethod
    def from_pretrained(
        cls, name_or_path: str | os.PathLike, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None,
        check_finite: bool = True, mmap: bool = True, device_map: str | dict | None = None,
        max_memory: dict | str | None = None, **processing: bool,
    ) -> "HookedTransformer":
        """Load a local folder in its family's Hugging Face layout, or a hub name via the local HF cache.

        `dtype` is a torch dtype, "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16", or "auto" (the
        checkpoint's own dtype on a GPU, float32 on the CPU); None is float32, the reference numerics
        (lenskit.devices). `device` defaults to the CPU. The family comes from config.json's `model_type`.
        A checkpoint already in `dtype` stays memory-mapped (no copy). Every weight is checked for NaN/inf,
        which reads every byte once; `check_finite=False` skips that for a checkpoint you trust.

        Memory-mapped weights are the file's pages: a file written in place under the model would change its
        next forward, and one truncated under it kills the process with SIGBUS. So each forward first checks
        (one `fstat` per file) that the files are as loaded, and refuses with
        "weights file changed since load; reload the model". Replacing a file by rename (save_pretrained,
        `hf download`) is safe: the model keeps the old file's pages. To edit weight files in place while the
        model is loaded, pass `mmap=False`: the weights are read into memory, and no file is touched after load.

        `device_map` spreads the model over devices instead of `device`: "auto" (accelerate's planner, under
        `max_memory`, e.g. {0: "20GiB", "cpu": "64GiB"}) or {module prefix: device}, blocks whole; blocks left on
        the CPU beside a GPU are offloaded, computed on the GPU one at a time (lenskit.placement).

        `fold_ln`, `center_writing_weights`, `center_unembed`, `fold_value_biases`, `refactor_factored_attn_matrices`
        (all False: the raw weights) process the weights as TransformerLens does; see `process_weights`."""
        return loading.load_pretrained(cls, name_or_path, dtype=dtype, device=device, check_finite=check_finite, mmap=mmap,
                               device_map=device_map, max_memory=max_memory, **processing)

    def process_weights(self, fold_ln: bool | None = None, center_writing_weights: bool | None = None,
                        center_unembed: bool | None = None, fold_value_biases: bool | None = None,
                        refactor_factored_attn_matrices: bool | None = False, inplace: bool = False) -> "HookedTransformer":
        """A copy (or with `inplace`, this model) with TransformerLens's weight processing (lenskit.processing): True
        applies an option or refuses saying why, None (the default) applies it where TransformerLens's default would
        and skips it where TransformerLens skips it; False skips it."""
        return process_weights(self, fold_ln, center_writing_weights, center_unembed, fold_value_biases,
                               refactor_factored_attn_matrices, inplace=inplace)

    @classmethod
    def from_hf(cls, hf_model: nn.Module, tokenizer: "PreTrainedTokenizerBase | None" = None) -> "HookedTransformer":
        """Convert an in-memory `transformers` causal LM of a supported family (e.g. `LlamaForCausalLM`)."""
        return loading.from_hf(cls, hf_model, tokenizer)

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write the family's own Hugging Face layout: config.json, model.safetensors and the tokenizer files."""
        loading.save_pretrained(self, folder)

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"name={c.name!r}, family={c.family!r}, n_layers={c.n_layers}, d_model={c.d_model}, n_heads={c.n_heads}, "
                f"n_kv_heads={c.n_kv_heads}, "
                f"d_mlp={c.d_mlp}, d_vocab={c.d_vocab}, n_ctx={c.n_ctx}")


def _embed_scaled(x: torch.Tensor) -> torch.Tensor:
    """x * sqrt(d_model), the multiplier rounded to x's dtype first, as Gemma's checkpoints were trained."""
    return x * torch.tensor(x.shape[-1] ** 0.5).to(device=x.device, dtype=x.dtype)  # fp32, then x's dtype


def _embed_as_is(x: torch.Tensor) -> torch.Tensor:
    return x


def _embed_times(scale: float, x: torch.Tensor) -> torch.Tensor:
    """x * scale (`cfg.scales.embedding`, Granite's embedding_multiplier), a Python float as transformers multiplies."""
    return x * scale

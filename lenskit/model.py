"""HookedTransformer: a decoder-only transformer (GPT-2, Pythia, Llama, Mistral, Qwen 2/3, Gemma 2/3, OLMo 2,
Phi-3, and the mixtures of experts Mixtral, Qwen3-MoE, OLMoE) whose every write to the residual stream passes a
named hook point."""

from __future__ import annotations

import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Iterable, Sequence, Union

import torch
from torch import nn

from .observe.cache import ActivationCache
from .config import ModelConfig
from .generation import generate
from .observe.hooks import CacheRecording, HookedRootModule, HookFn, NameOrPredicate, NamesFilter, HookPoint, layer_of
from .pieces.layers import make_block, make_norm
from .pieces.linear import Linear
from .pieces.readout import Readout
from .io.text import TextMethods, is_text
from .pieces.weights import WeightViews
from .placement import Placement

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TokensLike = Union[torch.Tensor, str, Sequence[str]]


class HookedTransformer(TextMethods, WeightViews, HookedRootModule):
    """A transformer with TransformerLens-style hook points, numerically equal to `transformers`' own
    class for its family. Positions are learned (`pos_embed`, `hook_pos_embed`) or rotary (inside
    attention); the choice is made once, here.

    >>> model = HookedTransformer.from_pretrained(lenskit.DEFAULT_MODEL)
    >>> logits, cache = model.run_with_cache("def __init__(self")
    >>> cache["resid_post", 3].shape   # [batch, pos, d_model]
    """

    ON_REQUEST = ("attn.hook_result", "mlp.hook_expert_out", "attn.hook_state")
    # The files from_pretrained left the weights memory-mapped from (lenskit.io.mapped), checked before each forward.
    weight_files = None
    # Where each block computes (lenskit.placement); None: all on the weights' one device, as `.to()` put them.
    placement: Placement | None = None
    # The weight processing applied (lenskit.processing), in order: () for the raw weights.
    processing: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig, tokenizer: "PreTrainedTokenizerBase | None" = None, dropout: float = 0.0) -> None:
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        if cfg.positional == "learned":
            self.pos_embed = nn.Embedding(cfg.n_ctx, cfg.d_model)
            self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        self._stream_start = self._embed_learned if cfg.positional == "learned" else self._embed_tokens
        self._embed_scale = _embed_scaled if cfg.scale_embed else _embed_as_is
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(make_block(cfg, dropout, i) for i in range(cfg.n_layers))
        self.ln_final = make_norm(cfg)
        self.unembed = Linear(cfg.d_model, cfg.d_vocab, bias=False)
        # Not a submodule: it holds ln_final and unembed themselves, so state dicts and hook names are unchanged.
        self.readout = Readout(self.ln_final, self.unembed, cfg.final_softcap)
        self.tie_weights()
        self.setup_hooks()
        self.init_weights()

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
            elif ".ln" in name or name.startswith("ln_final") or "_norm." in name:
                nn.init.ones_(p)  # Gemma's (1 + w) norms are reset to their own identity below
            elif residual_scaling and name.endswith(("attn.out.weight", "mlp.fc_out.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, 0.0, std)
        for module in self.modules():
            if getattr(module, "IDENTITY_WEIGHT", 1.0) != 1.0:
                nn.init.constant_(module.weight, module.IDENTITY_WEIGHT)

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: TokensLike, return_type: str | None = "logits", *,
                stop_at_layer: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """Logits [batch, pos, d_vocab] at every position; with `stop_at_layer=l`, the stream after l blocks.

        `return_type` as in TransformerLens: "logits", "loss" (mean next-token cross-entropy over every
        position but the last, nats), "both" (logits, loss) or None (run for the hooks, return nothing).
        The loss counts every position, so for right-padded texts pass equal-length token windows instead.
        """
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")
        n = self.cfg.n_layers
        if stop_at_layer is not None and not (isinstance(stop_at_layer, int) and not isinstance(stop_at_layer, bool)
                                              and -n <= stop_at_layer <= n):
            raise ValueError(f"stop_at_layer must be an int in [-{n}, {n}] (streams after 0..{n} blocks), got {stop_at_layer!r}")
        if self.weight_files is not None:
            self.weight_files.check()  # a mapped weights file written in place since load: refuse, do not compute
        tokens = self.validate_tokens(tokens)
        x = self.dropout(self._stream_start(tokens))  # [batch, pos, d_model]
        x = self.run_blocks(x, 0, stop_at_layer)
        if stop_at_layer is not None:
            return x
        logits = self.readout(x)  # [batch, pos, d_vocab]
        if return_type == "logits" or return_type is None:
            return logits if return_type else None
        loss = next_token_loss(logits, tokens)
        return loss if return_type == "loss" else (logits, loss)

    def run_blocks(self, x: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The stream [batch, pos, d_model] after blocks[start:stop], each on its device (`placement`)."""
        if self.placement is None:
            for block in self.blocks[start:stop]:
                x = block(x)  # [batch, pos, d_model]
            return x
        for layer in range(*slice(start, stop).indices(len(self.blocks))):
            x = self.placement.run(layer, self.blocks[layer], x)  # [batch, pos, d_model], on block layer's device
        return x

    def _embed_learned(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.hook_embed(self.embed(tokens)) + self.hook_pos_embed(self.pos_embed(positions).expand(tokens.shape[0], -1, -1))

    def _embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        # rotary families: positions enter inside attention. hook_embed sees the embedding as written, after any scale.
        return self.hook_embed(self._embed_scale(self.embed(tokens)))

    def readout_uncapped(self, h: torch.Tensor) -> torch.Tensor:
        """`model.readout.uncapped(h)`: the logits before any final soft-cap, which attribution splits into parts."""
        return self.readout.uncapped(h)

    def run_with_hooks(self, tokens: TokensLike, fwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]] = (),
                       bwd_hooks: Iterable[tuple[NameOrPredicate, HookFn]] = (), *, reset_hooks_end: bool = True,
                       **kwargs: Any) -> torch.Tensor:
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
        with self.hooks(fwd_hooks, bwd_hooks):
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
        **kwargs: Any,
    ) -> tuple[torch.Tensor | None, ActivationCache]:
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
        """
        if incl_bwd and not return_logits:
            raise ValueError("incl_bwd=True differentiates the model's output, so the run cannot stop early; "
                             "drop return_logits=False")
        if cache_device is not None and device is not None and torch.device(cache_device) != torch.device(device):
            raise ValueError(f"device={device!r} and cache_device={cache_device!r} both say where the cache goes; pass one")
        recording = CacheRecording(cache_device if cache_device is not None else device, dtype)
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
                    if not (isinstance(out, torch.Tensor) and out.ndim == 0 and out.requires_grad):
                        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
                        raise ValueError(f"incl_bwd=True calls .backward() on the model's output, which must be a scalar "
                                         f"with a gradient (return_type='loss', outside torch.no_grad()); got {got}")
                    out.backward()
        finally:
            recording.synchronise()  # offloaded entries hold their values from here on
            grads.synchronise()
        recording.check_unchanged()
        store = {**recording.store, **{f"{name}_grad": g for name, g in grads.store.items()}}
        return (out if return_logits else None), ActivationCache(store, self.cfg.n_layers, self)

    def _unknown(self, name: str) -> KeyError:
        """An unknown hook name; one that a block's kind of token mixer lacks (a linear-attention block's
        `attn.hook_pattern`) names the block's kind."""
        layer = layer_of(name)
        if layer is not None and layer < len(self.blocks):
            attn = self.blocks[layer].attn
            if name.removeprefix(f"blocks.{layer}.attn.") in getattr(attn, "NO_HOOKS", ()):
                return KeyError(f"{name}: block {layer} is a {attn.LAYER_TYPE} layer, which has no attention scores, "
                                f"pattern, rotary or per-head results; use its attn.hook_q/k/v, hook_beta, hook_g, hook_z "
                                f"or hook_state, or a block whose layer type is 'full' ({self.cfg.layer_types})")
        return super()._unknown(name)

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

    generate = generate  # lenskit/generation.py: greedy, or sampled with a seedable generator

    def add_hook(self, name: NameOrPredicate, fn: HookFn, dir: str = "fwd") -> None:
        """Attach `fn` to a hook point (or every point a predicate selects) GLOBALLY: every thread and every
        later call sees it until `reset_hooks()`. `dir="bwd"` attaches a backward hook (`lenskit.observe.backward`).
        Prefer `model.hooks(...)` / `run_with_hooks`, which are temporary and belong to the calling thread."""
        if not callable(fn):
            raise TypeError(f"hook for {name!r} is not callable: {fn!r}")
        if dir not in ("fwd", "bwd"):
            raise ValueError(f"dir must be 'fwd' or 'bwd', got {dir!r}")
        for hp in self._resolve(name):
            hp.add_hook(fn, dir=dir)

    # --------------------------------------------------------------- tokens
    def validate_tokens(self, tokens: TokensLike) -> torch.Tensor:
        """Text becomes tokens; token tensors are checked for dtype, shape, vocabulary and context length."""
        if is_text(tokens):
            tokens = self.to_tokens(tokens)
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

    # ------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls, name_or_path: str | os.PathLike, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None,
        check_finite: bool = True, mmap: bool = True, device_map: str | dict | None = None,
        max_memory: dict | str | None = None, **processing: bool,
    ) -> "HookedTransformer":
        """Load a local folder in its family's Hugging Face layout, or a hub name via the local HF cache.

        `dtype` is a torch dtype or "float32" / "bfloat16" / "float16" (None: float32, the reference
        numerics); `device` defaults to the CPU. The family comes from config.json's `model_type`.
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
        from .io.loading import load_pretrained

        return load_pretrained(cls, name_or_path, dtype=dtype, device=device, check_finite=check_finite, mmap=mmap,
                               device_map=device_map, max_memory=max_memory, **processing)

    def process_weights(self, fold_ln: bool | None = None, center_writing_weights: bool | None = None,
                        center_unembed: bool | None = None, fold_value_biases: bool | None = None,
                        refactor_factored_attn_matrices: bool | None = False, inplace: bool = False) -> "HookedTransformer":
        """A copy (or with `inplace`, this model) with TransformerLens's weight processing (lenskit.processing): True
        applies an option or refuses saying why, None (the default) applies it where TransformerLens's default would
        and skips it where TransformerLens skips it; False skips it."""
        from .processing import process_weights

        return process_weights(self, fold_ln, center_writing_weights, center_unembed, fold_value_biases,
                               refactor_factored_attn_matrices, inplace=inplace)

    @classmethod
    def from_hf(cls, hf_model: nn.Module, tokenizer: "PreTrainedTokenizerBase | None" = None) -> "HookedTransformer":
        """Convert an in-memory `transformers` causal LM of a supported family (e.g. `LlamaForCausalLM`)."""
        from .io.loading import from_hf

        return from_hf(cls, hf_model, tokenizer)

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write the family's own Hugging Face layout: config.json, model.safetensors and the tokenizer files."""
        from .io.loading import save_pretrained

        save_pretrained(self, folder)

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"name={c.name!r}, family={c.family!r}, n_layers={c.n_layers}, d_model={c.d_model}, n_heads={c.n_heads}, "
                f"n_kv_heads={c.n_kv_heads}, "
                f"d_mlp={c.d_mlp}, d_vocab={c.d_vocab}, n_ctx={c.n_ctx}")


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) of predicting tokens[:, 1:] from logits[:, :-1]."""
    if tokens.shape[1] < 2:
        raise ValueError("a loss needs at least 2 tokens per sequence (each position predicts the next)")
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _embed_scaled(x: torch.Tensor) -> torch.Tensor:
    """x * sqrt(d_model), the multiplier rounded to x's dtype first, as Gemma's checkpoints were trained."""
    return x * torch.tensor(x.shape[-1] ** 0.5).to(device=x.device, dtype=x.dtype)  # fp32, then x's dtype


def _embed_as_is(x: torch.Tensor) -> torch.Tensor:
    return x

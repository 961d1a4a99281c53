"""`transformer_lens.HookedTransformer` as TransformerLens 3 defines its defaults, over lenskit's model.

The computation is `lenskit.HookedTransformer`'s. This class only sets what TransformerLens code expects by default:
- text input gets BOS first (`cfg.default_prepend_bos = True`), where lenskit follows the checkpoint's tokenizer;
- `from_pretrained` processes the weights as TransformerLens does (fold_ln, center_writing_weights, center_unembed,
  fold_value_biases; lenskit.processing), where lenskit loads them raw; `from_pretrained_no_processing` loads them raw;
- the unembedding has TransformerLens's hook points `unembed.hook_in` (its input, ln_final's output) and
  `unembed.hook_out` (the logits before any final soft-cap), cached by default as there;
- `run_with_cache` returns the namespace's `ActivationCache` (TransformerLens's layer-0 remainder);
- where TransformerLens asserts (a hook on a point whose `set_use_*` switch is off, `get_token_position` of a
  token not in the prompt, `remove_batch_dim` of several sequences), the error is also an `AssertionError`;
- each attention module has TransformerLens's `attn_type` ("global", or "local" for a sliding window or Llama 4's
  chunks) beside its `mask` (lenskit's mask object, which code may share between layers of one type, as
  circuit-tracer does);
- `cfg.to_dict()` gives TransformerLens's field names, and `cfg.output_logits_soft_cap` (the final logit cap, 0.0
  for none) can be written, as code written for TransformerLens does to run without the cap for a while (writing
  it changes this model's forward, nothing else);
- the forward reads out through whatever module `model.unembed` is when it runs, so code that wraps the
  unembedding (circuit-tracer does) sees its wrapper called; lenses and lenskit's readout helpers keep using the
  unembedding the model was built with;
- a backward hook from `hooks(bwd_hooks=...)` / `run_with_hooks` stays on the graphs of the forwards run in the
  block, as TransformerLens's do, so a backward after the block calls it (lenskit's own turn off on exit);
- `to_tokens` truncates to n_ctx, and `generate` samples, shows a progress bar and gives text for text, as
  TransformerLens's do;
- the forward takes `start_at_layer=` (a stream entering that block, as `input_to_embed` gives one);
- the norms are always written out, as TransformerLens's are, so caching their hooks moves no number (lenskit's own
  run the fused kernel when no norm hook is on, equal to rounding).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch

import lenskit
from lenskit.config import ModelConfig
from lenskit.config_names import note_prepend_bos
from lenskit.devices import parse_dtype
from lenskit.io.hub import resolve_model_folder
from lenskit.io.text import check_padding_side
from lenskit.observe.hook_context import HOOK_CONTEXT
from lenskit.observe.hooks import HookedRootModule, HookPoint  # noqa: F401 - HookedRootModule: imported from here by SAELens
from lenskit.observe.slices import Slice
from lenskit.pieces.attention import ChunkedMask, SlidingWindowMask
from lenskit.pieces.embeddings import Unembed
from lenskit.pieces.forward_state import ForwardState
from lenskit.pieces.norms import LayerNorm, RMSNorm
from lenskit.pieces.readout import Readout

from .ActivationCache import ActivationCache
from .errors import ValueAssertionError, asserts
from .HookedTransformerConfig import HookedTransformerConfig, to_model_config
from .loading_from_pretrained import tl_fields

# TransformerLens's type names for what `forward` returns, imported from this module by code written for it.
Loss = torch.Tensor  # a scalar, or [batch, pos - 1] per token
Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None  # logits, loss, both, or nothing

PROCESSING = ("fold_ln", "center_writing_weights", "center_unembed", "fold_value_biases", "refactor_factored_attn_matrices")


class HookedTransformer(lenskit.HookedTransformer):
    """lenskit's hooked transformer with TransformerLens 3's defaults (see the module's docstring).

    >>> import lenskit.transformer_lens as transformer_lens
    >>> model = transformer_lens.HookedTransformer.from_pretrained("stdlib-gpt2")
    >>> model.to_str_tokens("def f")[0]   # BOS first, as TransformerLens does
    '<|endoftext|>'
    """

    cfg: "NamespaceConfig"  # __setattr__ below makes every config one

    def __init__(self, cfg: ModelConfig | HookedTransformerConfig | dict, tokenizer: Any = None,
                 move_to_device: bool = True, default_padding_side: str = "right") -> None:
        check_padding_side(default_padding_side)
        tl_cfg = cfg if isinstance(cfg, HookedTransformerConfig) else None
        if isinstance(cfg, dict):
            tl_cfg = HookedTransformerConfig(**cfg)
        if tl_cfg is not None:
            cfg, tokenizer = to_model_config(tl_cfg, tokenizer)
            if tl_cfg.seed is not None:
                torch.manual_seed(tl_cfg.seed)  # TransformerLens seeds the init with it
        super().__init__(cfg, tokenizer=tokenizer)
        note_prepend_bos(self.cfg, True if tl_cfg is None else tl_cfg.default_prepend_bos)
        # In place, not a new module: the readout and a tied embedding hold this very object.
        self.unembed.__class__ = HookedUnembed
        self.unembed.hook_in, self.unembed.hook_out = HookPoint(), HookPoint()
        self.setup_hooks()
        self.readout = LiveReadout(self)
        for module in self.modules():  # TransformerLens's norms are written out, so caching one moves no number
            if type(module) in WRITTEN_OUT:
                module.__class__ = WRITTEN_OUT[type(module)]
        for block in self.blocks:  # TransformerLens's name for the kind of mask a layer's attention applies
            mask = getattr(getattr(block, "attn", None), "mask", None)
            if mask is not None:
                block.attn.attn_type = "local" if isinstance(mask, (SlidingWindowMask, ChunkedMask)) else "global"
        if tl_cfg is not None:
            for switch in ("use_attn_result", "use_split_qkv_input", "use_hook_mlp_in", "use_attn_in"):
                if getattr(tl_cfg, switch):
                    getattr(self, f"set_{switch}")(True)
            if not self.embed.weight.is_meta:
                self.to(dtype=tl_cfg.dtype)
                if move_to_device and tl_cfg.device is not None:
                    self.to(tl_cfg.device)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "cfg" and isinstance(value, ModelConfig) and not isinstance(value, NamespaceConfig):
            object.__setattr__(value, "__class__", NamespaceConfig)  # same fields: to_dict, a writable soft-cap
        super().__setattr__(name, value)

    @classmethod
    def from_pretrained(cls, model_name: str | os.PathLike, fold_ln: bool = True, center_writing_weights: bool = True,
                        center_unembed: bool = True, refactor_factored_attn_matrices: bool = False,
                        checkpoint_index: int | None = None, checkpoint_value: int | None = None,
                        hf_model: torch.nn.Module | None = None, device: str | torch.device | None = None,
                        n_devices: int = 1, tokenizer: Any = None, move_to_device: bool = True,
                        fold_value_biases: bool = True, default_prepend_bos: bool | None = None,
                        default_padding_side: str = "right", dtype: torch.dtype | str = "float32",
                        first_n_layers: int | None = None, **kwargs: Any) -> "HookedTransformer":
        """A local folder, an embedded model's short name or a hub name in the local cache (no download), processed
        as TransformerLens processes it. An option TransformerLens would skip for the family (centring under RMSNorm)
        is skipped, as there; one that cannot be exact for it is refused by name (lenskit.processing).

        `hf_model` converts a `transformers` model already in memory instead. `n_devices` spreads the blocks evenly
        over the first GPUs, as TransformerLens does (lenskit's `device_map` does more)."""
        check_padding_side(default_padding_side)
        for name, value in (("checkpoint_index", checkpoint_index), ("checkpoint_value", checkpoint_value),
                            ("first_n_layers", first_n_layers)):
            if value is not None:
                raise ValueError(f"{name}={value!r}: lenskit loads one checkpoint whole (training checkpoints are "
                                 "separate folders; stop_at_layer= runs the first layers); drop it")
        options = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights, center_unembed=center_unembed,
                       fold_value_biases=fold_value_biases, refactor_factored_attn_matrices=refactor_factored_attn_matrices)
        # TransformerLens's True means "where it applies to this family": lenskit's None says exactly that.
        processing = {k: (None if v is True and k != "refactor_factored_attn_matrices" else v) for k, v in options.items()}
        if hf_model is not None:
            model = cls.from_hf(hf_model, tokenizer=tokenizer)
            model = model.to(device=device or "cpu", dtype=parse_dtype(dtype))
            model = model.process_weights(**processing, inplace=True)
        else:
            if n_devices != 1:
                kwargs.setdefault("device_map", _even_device_map(model_name, n_devices))
            model = super().from_pretrained(model_name, dtype=dtype, device=device, **kwargs, **processing)
            if tokenizer is not None:
                model.tokenizer = tokenizer
        note_prepend_bos(model.cfg, True if default_prepend_bos is None else default_prepend_bos)
        return model

    @classmethod
    def from_pretrained_no_processing(cls, model_name: str | os.PathLike, fold_ln: bool = False,
                                      center_writing_weights: bool = False, center_unembed: bool = False,
                                      refactor_factored_attn_matrices: bool = False, fold_value_biases: bool = False,
                                      dtype: torch.dtype | str = "float32", default_prepend_bos: bool | None = None,
                                      default_padding_side: str = "right", **kwargs: Any) -> "HookedTransformer":
        """The raw weights: `from_pretrained` with every processing option off unless given."""
        return cls.from_pretrained(model_name, fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                                   center_unembed=center_unembed, fold_value_biases=fold_value_biases,
                                   refactor_factored_attn_matrices=refactor_factored_attn_matrices, dtype=dtype,
                                   default_prepend_bos=default_prepend_bos, default_padding_side=default_padding_side,
                                   **kwargs)

    def forward(self, input: Any, return_type: str | None = "logits", *, start_at_layer: int | None = None,
                tokens: torch.Tensor | None = None, shortformer_pos_embed: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, stop_at_layer: int | None = None, **kwargs: Any) -> Any:
        """lenskit's forward, and TransformerLens's `start_at_layer=l`: `input` is then the residual stream
        [batch, pos, d_model] entering block l (as `input_to_embed` gives it), which runs blocks[l:stop_at_layer]
        (a negative l counts from the end, as a slice does); `tokens` are needed only for return_type="loss"."""
        _refuse_masks(shortformer_pos_embed, attention_mask)
        if start_at_layer is None:
            return super().forward(input, return_type, stop_at_layer=stop_at_layer, **kwargs)
        n = self.cfg.n_layers
        if not (isinstance(start_at_layer, int) and not isinstance(start_at_layer, bool) and -n <= start_at_layer < n):
            raise ValueError(f"start_at_layer must be an int in [-{n}, {n - 1}] (the block the stream enters), "
                             f"got {start_at_layer!r}")
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")
        if kwargs:
            raise ValueError(f"start_at_layer= starts from a residual stream, so {sorted(kwargs)} (options of token "
                             "input) do not apply; drop them")
        if not (isinstance(input, torch.Tensor) and input.is_floating_point() and input.ndim == 3
                and input.shape[-1] == self.cfg.d_model):
            raise ValueError(f"with start_at_layer= the input is the residual stream [batch, pos, {self.cfg.d_model}], "
                             f"got {_described(input)}; input_to_embed(tokens)[0] gives it")
        if self.cfg.block.d_per_layer is not None and tokens is None:
            raise ValueError("this model's blocks read per-layer inputs from the token ids: pass tokens= with start_at_layer=")
        if return_type in ("loss", "both") and tokens is None:
            raise ValueError(f"return_type={return_type!r} needs the token ids: pass tokens= with start_at_layer=")
        # The blocks' side inputs (Gemma 4's per-layer inputs) come from the tokens, as in lenskit's forward.
        state = ForwardState(0, None, None if tokens is None else self._side_inputs(tokens, input))
        x = self.run_blocks(input, start_at_layer, stop_at_layer, state)
        if stop_at_layer is not None:
            return x
        logits = self.readout(x)  # [batch, pos, d_vocab]
        if return_type in ("logits", None):
            return logits if return_type else None
        loss = self.loss_fn(logits, tokens)
        return loss if return_type == "loss" else (logits, loss)

    def input_to_embed(self, input: Any, prepend_bos: bool | None = None, padding_side: str | None = None,
                       attention_mask: torch.Tensor | None = None, past_kv_cache: Any = None) -> tuple:
        """TransformerLens's (residual [batch, pos, d_model], tokens [batch, pos], shortformer_pos_embed, attention_mask):
        the stream entering block 0, to pass back with `start_at_layer=0`. lenskit builds no shortformer positions,
        so that entry is None; attention_mask is returned as given."""
        _refuse_masks(None, attention_mask)
        if past_kv_cache is not None:
            raise ValueError("input_to_embed(past_kv_cache=...) is not supported: run the tokens with "
                             "model(tokens, past_kv_cache=...) instead")
        tokens = self.validate_tokens(input, prepend_bos, padding_side)
        return self._stream_start(tokens, 0), tokens, None, attention_mask

    def run_with_cache(self, *model_args: Any, pos_slice: Any = None, remove_batch_dim: bool = False,
                       return_cache_object: bool = True, **kwargs: Any) -> tuple[Any, Any]:
        """`lenskit.HookedTransformer.run_with_cache` giving the namespace's `ActivationCache`, and TransformerLens's
        `pos_slice=`: each cached activation keeps only the positions it selects (an int keeps its axis, as there),
        queries for attention patterns and scores. The run itself sees every position; the slicing is of what is
        kept."""
        out, cache = super().run_with_cache(*model_args, **kwargs)
        cache.__class__ = ActivationCache  # same state, the namespace's methods
        if remove_batch_dim:
            cache.remove_batch_dim()
        if pos_slice is not None:
            keep = Slice.unwrap(pos_slice)
            store = cache.cache_dict
            for name, tensor in store.items():
                store[name] = keep.apply(tensor, _query_axis(name.removesuffix("_grad"), not remove_batch_dim))
        return out, (cache if return_cache_object else cache.cache_dict)

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Any = (), bwd_hooks: Any = (), reset_hooks_end: bool = True,
              clear_contexts: bool = False) -> Iterator["HookedTransformer"]:
        """lenskit's `hooks()`, except that a backward hook stays on the graph of each forward run inside the
        block, as in TransformerLens (torch keeps a module's backward hooks with the graph a forward builds), so a
        `.backward()` after the block still calls it; forwards after the block do not see it. circuit-tracer runs
        its forward inside the block and its backward passes after."""
        kept: list = []
        try:
            with super().hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts):
                kept = [a for attached in (HOOK_CONTEXT.get().bwd or {}).values() for a in attached]
                yield self
        finally:
            for attachment in kept:
                attachment.live = True

    @asserts
    def add_hook(self, name: Any, hook: Any, dir: str = "fwd", is_permanent: bool = False, level: int | None = None,
                 prepend: bool = False) -> None:
        """lenskit's `add_hook`; as in TransformerLens, a hook on `attn.hook_result` needs `set_use_attn_result(True)`
        first (lenskit computes it whenever hooked), and one on a point another switch adds needs that switch."""
        if isinstance(name, str) and name.endswith("attn.hook_result") and "attn.hook_result" in self.ON_REQUEST:
            raise ValueAssertionError(f"cannot hook {name} while use_attn_result is off (TransformerLens's rule); "
                                      "call model.set_use_attn_result(True) first")
        super().add_hook(name, hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)

    @asserts
    def get_token_position(self, *args: Any, **kwargs: Any) -> Any:
        return super().get_token_position(*args, **kwargs)

    def to_tokens(self, input: str | list[str], prepend_bos: bool | None = None, padding_side: str | None = None,
                  move_to_device: bool = True, truncate: bool = True) -> torch.Tensor:
        """`lenskit.HookedTransformer.to_tokens`, truncating to n_ctx by default as TransformerLens does."""
        return super().to_tokens(input, prepend_bos, padding_side, move_to_device, truncate)


    def generate(self, input: Any = "", max_new_tokens: int = 10, stop_at_eos: bool = True,
                 eos_token_id: int | list[int] | None = None, do_sample: bool = True, top_k: int | None = None,
                 top_p: float | None = None, temperature: float = 1.0, freq_penalty: float = 0.0,
                 use_past_kv_cache: bool = True, prepend_bos: bool | None = None, padding_side: str | None = None,
                 return_type: str = "input", verbose: bool = True, generator: torch.Generator | None = None) -> Any:
        """`lenskit.HookedTransformer.generate` in TransformerLens 3's argument order and defaults: sampled, 10 new
        tokens, text in gives text out (`return_type="input"`), a progress bar. `generator` seeds the sampling
        (TransformerLens samples from torch's global generator, which `torch.manual_seed` seeds; so does lenskit
        without one)."""
        return super().generate(input, max_new_tokens, stop_at_eos=stop_at_eos, eos_token_id=eos_token_id,
                                do_sample=do_sample, top_k=top_k, top_p=top_p, temperature=temperature,
                                freq_penalty=freq_penalty, use_past_kv_cache=use_past_kv_cache,
                                prepend_bos=prepend_bos, padding_side=padding_side, return_type=return_type,
                                verbose=verbose, generator=generator)


class NamespaceConfig(ModelConfig):
    """lenskit's frozen config with TransformerLens's `to_dict()` and one writable field, `output_logits_soft_cap`
    (TransformerLens's name for `final_softcap`; 0.0 or below: no cap), which the namespace's forward reads."""

    @property
    def output_logits_soft_cap(self) -> float:
        return self.__dict__.get("_softcap_override", self.final_softcap or 0.0)

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "output_logits_soft_cap":
            return super().__setattr__(name, value)  # refused: the config is frozen
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"output_logits_soft_cap must be a number (0.0 for no cap), got {value!r}")
        object.__setattr__(self, "_softcap_override", float(value))

    def to_dict(self) -> dict[str, Any]:
        return {**tl_fields(self), "output_logits_soft_cap": self.output_logits_soft_cap,
                "model_name": self.model_name, "tokenizer_name": self.model_name, "device": self.device,
                "dtype": self.dtype}


class LiveReadout(Readout):
    """The namespace model's readout: the forward calls `model.unembed` as it is at call time (a wrapper put there
    runs) and caps with `model.cfg.output_logits_soft_cap`; the weight-based helpers (`into`, `weight`, lenses) use
    the unembedding the model was built with."""

    def __init__(self, model: "HookedTransformer") -> None:
        super().__init__(model.ln_final, model.unembed, model.cfg.final_softcap)
        self._model = model

    @property
    def softcap(self) -> float | None:
        cap = self._model.cfg.output_logits_soft_cap
        return cap if cap > 0 else None

    @softcap.setter
    def softcap(self, value: float | None) -> None:
        pass  # read from the model's config at each call (Readout.__init__ sets it once)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.cap_(self.uncapped(h))

    def uncapped(self, h: torch.Tensor) -> torch.Tensor:
        return self._model.unembed(self.norm(h.to(self.unembed.weight.device)))


class HookedUnembed(Unembed):
    """lenskit's unembedding with TransformerLens's two hook points around it. Only the namespace's model has them:
    lenskit's own hook set (and what its cache holds by default) stays as DESIGN.md lists it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_out(super().forward(self.hook_in(x)))  # [..., d_model] -> [..., d_vocab]


def _query_axis(name: str, batched: bool) -> int:
    """The position axis `pos_slice` selects along in activation `name`: the query's in a pattern or scores
    [batch, head, query_pos, key_pos] and in a sink's share [batch, head, query_pos]; else pos in [batch, pos, ...]."""
    if name.endswith(("hook_pattern", "hook_attn_scores")):
        return -2
    if name.endswith("hook_sink"):
        return -1
    return 1 if batched else 0


def _even_device_map(model_name: str | os.PathLike, n_devices: int) -> dict[str, str]:
    """TransformerLens's split: blocks in order, n_layers / n_devices to each GPU; embeddings on the first GPU, the
    readout on the last (on the first where it is tied to the embedding)."""
    if not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"n_devices must be an int >= 1, got {n_devices!r}")
    if n_devices > torch.cuda.device_count():
        raise ValueError(f"n_devices={n_devices} but torch sees {torch.cuda.device_count()} GPUs")
    cfg = ModelConfig.from_json(resolve_model_folder(model_name) / "config.json")
    per = -(-cfg.n_layers // n_devices)  # ceil
    readout = "cuda:0" if cfg.tie_word_embeddings else f"cuda:{n_devices - 1}"
    return {"embed": "cuda:0", "pos_embed": "cuda:0", "ln_final": readout, "unembed": readout,
            **{f"blocks.{i}": f"cuda:{i // per}" for i in range(cfg.n_layers)}}


def _refuse_masks(shortformer_pos_embed: Any, attention_mask: Any) -> None:
    """TransformerLens's forward arguments that lenskit has no counterpart for, refused unless they change nothing."""
    if shortformer_pos_embed is not None:
        raise ValueError("shortformer_pos_embed: lenskit builds no shortformer positions; pass None")
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).all()):
        raise ValueError("attention_mask with masked positions: lenskit's forward reads every position; run "
                         "unpadded windows (or each text alone) instead, or pass None")


def _described(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


class WrittenOutLayerNorm(LayerNorm):
    """lenskit's LayerNorm, always step by step as a hooked run computes it (TransformerLens's LayerNorm is), so
    that a run caching its hooks gives the numbers of a run that does not, bit for bit (the fused kernel rounds
    differently, by about 1e-7 of the output)."""

    forward = LayerNorm.written_out


class WrittenOutRMSNorm(RMSNorm):
    """RMSNorm's counterpart of WrittenOutLayerNorm."""

    forward = RMSNorm.written_out


WRITTEN_OUT = {LayerNorm: WrittenOutLayerNorm, RMSNorm: WrittenOutRMSNorm}

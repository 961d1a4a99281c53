"""HookedTransformer: a decoder-only transformer (GPT-2, Pythia, Llama, Mistral, Qwen 2/3, Gemma 2/3, OLMo 2,
Phi-3, and the mixtures of experts Mixtral, Qwen3-MoE, OLMoE) whose every write to the residual stream passes a
named hook point."""

from __future__ import annotations

import copy
import math
import os
from typing import TYPE_CHECKING, Sequence, Union

import torch
from torch import nn

from .config import ModelConfig
from .config_names import note_placement
from .conveniences import ModelConveniences
from .generation import generate
from .kv_cache import KVCache, extending, start_position
from .observe.hook_context import positions_from
from .observe.hooks import HookedRootModule, HookPoint
from .observe.running import RunMethods
from .observe.switches import SwitchMethods
from .pieces.forward_state import ForwardState
from .pieces.layers import make_block, make_norm
from .pieces.embeddings import Embed, PosEmbed, Unembed
from .pieces.per_layer import PerLayerInputs, side_inputs
from .pieces.readout import Readout
from .io.text import TextMethods
from .losses import next_token_loss
from .pieces.weights import WeightViews
from .placement import Placement

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TokensLike = Union[torch.Tensor, str, Sequence[str]]


class HookedTransformer(RunMethods, TextMethods, WeightViews, ModelConveniences, SwitchMethods, HookedRootModule):
    """A transformer with TransformerLens-style hook points, numerically equal to `transformers`' own
    class for its family. Positions are learned (`pos_embed`, `hook_pos_embed`) or rotary (inside
    attention); the choice is made once, here.

    >>> model = HookedTransformer.from_pretrained(lenskit.DEFAULT_MODEL)
    >>> logits, cache = model.run_with_cache("def __init__(self")
    >>> cache["resid_post", 3].shape   # [batch, pos, d_model]
    torch.Size([1, 5, 192])
    """

    ON_REQUEST = ("attn.hook_result", "mlp.hook_expert_out", "attn.hook_state")
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
        self._embed_scale = _embed_scaled if cfg.scale_embed else _embed_as_is
        self.dropout = nn.Dropout(dropout)
        if cfg.block.d_per_layer is not None:  # Gemma 4 E2B/E4B: an input per block, from the tokens (lenskit.pieces.per_layer)
            self.per_layer_inputs = PerLayerInputs(cfg)
        self._side_inputs = side_inputs(self, cfg)  # chosen once: what the blocks read beside the stream, if anything
        self.blocks = nn.ModuleList(make_block(cfg, dropout, i) for i in range(cfg.n_layers))
        self.ln_final = make_norm(cfg)
        self.unembed = Unembed(cfg.d_model, cfg.d_vocab, bias=False)
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

    generate = generate  # lenskit/generation.py: greedy, or sampled with a seedable generator

    # ------------------------------------------------------------- loading
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


def _embed_scaled(x: torch.Tensor) -> torch.Tensor:
    """x * sqrt(d_model), the multiplier rounded to x's dtype first, as Gemma's checkpoints were trained."""
    return x * torch.tensor(x.shape[-1] ** 0.5).to(device=x.device, dtype=x.dtype)  # fp32, then x's dtype


def _embed_as_is(x: torch.Tensor) -> torch.Tensor:
    return x

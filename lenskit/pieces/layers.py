"""The blocks that put the pieces together: sequential (pre-norm, sandwich, post-norm, Gemma 4's sandwich
with a stored scale of the stream), parallel, or attention with a Mamba-2 mixer beside it (Falcon-H1).

Architecture options are separate classes chosen once from the config (`make_norm` in norms.py,
`Attention`'s pieces in attention.py, `make_mlp` and `make_block` here), so each forward reads
like the maths and has no family branches. A block's MLP is a mixture of experts (moe.py) where the config
makes that block sparse, else one of the dense MLPs in mlp.py.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint
from .absent import NoMixer, NoMLP
from .attention import Attention
from .deltanet import GatedDeltaNet
from .dense_and_experts import DenseAndExperts
from .forward_state import ForwardState, needed
from .kv_sharing import SharedKVAttention
from .latent_attention import LatentAttention
from .mamba2 import Mamba2Mixer
from .mlp import MLP, MLP_CLASSES, FusedSwiGLU, GeluMLP, ScaledSwiGLU, SwiGLU
from .moe import MoE
from .norms import LayerNorm, RMSNorm, make_norm, norm_params
from .per_layer import PerLayerWrite
from .shared_experts import ScoredInputMoE, SharedExpertsMoE

__all__ = ["Attention", "FusedSwiGLU", "GeluMLP", "LayerNorm", "MLP", "MambaBesideAttentionBlock", "MoE", "ParallelBlock", "PostNormBlock", "RMSNorm", "RescaledSandwichBlock", "SandwichBlock",
           "SwiGLU", "TransformerBlock", "make_block", "make_mlp", "make_norm"]


def mlp_class(cfg: ModelConfig, layer: int = 0) -> type[MLP] | type[MoE] | type[NoMLP]:
    """The piece of block `layer`'s MLP: none in a one-sublayer model's mixer-only block (Nemotron-H), a mixture of
    experts where the config makes that block sparse (SharedExpertsMoE under DeepSeek's `sigmoid_group_topk` routing
    and wherever there are shared experts; Llama 4's ScoredInputMoE under `sigmoid_topk`), the dense MLP with experts
    beside it (Gemma 4 26B-A4B), else the dense MLP."""
    if cfg.block.one_sublayer and cfg.layer_type(layer) != "mlp":
        return NoMLP
    if cfg.block.experts_beside_mlp:
        return DenseAndExperts
    if not cfg.is_moe_layer(layer):
        scaled = cfg.scales.mlp_gate != 1.0  # Falcon-H1's gate multiplier; the write's is the output projection's
        return ScaledSwiGLU if scaled and cfg.mlp == "swiglu" else MLP_CLASSES[cfg.mlp]
    if cfg.moe.routing == "sigmoid_topk":
        return ScoredInputMoE
    shared = cfg.moe.routing.startswith("sigmoid_group_topk") or cfg.moe.n_shared_experts
    return SharedExpertsMoE if shared else MoE


def make_mlp(cfg: ModelConfig, layer: int = 0) -> MLP | MoE:
    """Block `layer`'s MLP (`mlp_class`), a dense one `cfg.d_mlp_of(layer)` wide."""
    cls = mlp_class(cfg, layer)
    if issubclass(cls, (MoE, NoMLP)):  # routed experts only: their widths are the config's
        return cls(cfg)
    return cls(cfg, cfg.d_mlp_of(layer))


def attention_class(cfg: ModelConfig, layer: int = 0) -> type[Attention] | type[GatedDeltaNet] | type[Mamba2Mixer]:
    """The piece of block `layer`'s token mixer: softmax attention (with an earlier block's keys and values where it
    shares them, `cfg.kv_source`; latent attention where the config has `mla.kv_lora_rank`), or linear attention or a
    Mamba-2 mixer where the config makes that block "linear" or "mamba"."""
    if cfg.layer_type(layer) == "linear":
        return GatedDeltaNet
    if cfg.layer_type(layer) == "mamba":
        return Mamba2Mixer
    if cfg.layer_type(layer) == "mlp":
        return NoMixer
    if cfg.mla.kv_lora_rank is not None:
        return LatentAttention
    return SharedKVAttention if cfg.kv_source(layer) is not None else Attention


def make_attention(cfg: ModelConfig, layer: int = 0) -> Attention | GatedDeltaNet | Mamba2Mixer:
    """Block `layer`'s token mixer (`attention_class`)."""
    cls = attention_class(cfg, layer)
    if issubclass(cls, (GatedDeltaNet, Mamba2Mixer)):  # one shape for every linear or Mamba-2 block
        return cls(cfg)
    return cls(cfg, layer)


def mixer_classes(cfg: ModelConfig, layer: int = 0) -> tuple[type[Attention] | type[GatedDeltaNet] | type[Mamba2Mixer], ...]:
    """Block `layer`'s token mixers: its `attention_class`, then the Mamba-2 mixer beside it where the block has one
    (Falcon-H1's `block.mamba_beside_attention`). Accounting sums their FLOPs and processing asks each for refusals."""
    own = attention_class(cfg, layer)
    return (own, Mamba2Mixer) if cfg.block.mamba_beside_attention else (own,)


def summed_counts(*counts: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """Pieces' counts by accounting row, added row by row: (weights, biases) each."""
    out: dict[str, tuple[int, int]] = {}
    for count in counts:
        for row, (weights, biases) in count.items():
            w, b = out.get(row, (0, 0))
            out[row] = (w + weights, b + biases)
    return out


class TransformerBlock(nn.Module):
    """Pre-LN block: each sublayer reads a normalised copy of the stream and adds its write back."""

    PRE_NORMS, POST_NORMS = True, False  # which of ln1/ln2 (before) and ln1_post/ln2_post (after) exist

    @classmethod
    def processing_refusal(cls, cfg: ModelConfig, option: str) -> tuple[str, bool] | None:
        """Why weight processing's `option` cannot be applied to this block form (lenskit.processing); None here."""
        return None

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Block `layer`'s parameters by accounting row (lenskit.accounting), as (weights, biases): its own norms, and
        what its pieces count (the token mixer's `attn`, the MLP's `mlp`, their norms)."""
        norm_w, norm_b = norm_params(cfg)
        n = 2 * cls.PRE_NORMS + 2 * cls.POST_NORMS
        return summed_counts({"norms": (n * norm_w, n * norm_b)}, attention_class(cfg, layer).params(cfg, layer),
                             mlp_class(cfg, layer).params(cfg, layer))

    def __init__(self, cfg: ModelConfig, dropout: float = 0.0, layer: int = 0) -> None:
        super().__init__()
        if self.PRE_NORMS:
            self.ln1 = make_norm(cfg)
            self.ln2 = make_norm(cfg)
        if self.POST_NORMS:
            self.ln1_post = make_norm(cfg)
            self.ln2_post = make_norm(cfg)
        self.attn = make_attention(cfg, layer)
        self.mlp = make_mlp(cfg, layer)
        self.dropout = nn.Dropout(dropout)
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_mid = HookPoint()  # [batch, pos, d_model]
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_model]
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        """The stream after this block [batch, pos, d_model] from x, the stream before it, with the forward's `state`
        (lenskit.pieces.forward_state: the KV cache and what else the forward hands down; None for a block alone)."""
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(self.dropout(self.read_attn(x, state))))
        x = self.hook_resid_post(x + self.hook_mlp_out(self.dropout(self.mlp(self.ln2(x)))))
        return x

    def read_attn(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        """The attention's write [batch, pos, d_model] from the stream: attn(ln1(x)). TransformerLens's per-head input
        switches (lenskit.observe.switches) replace this reading, once, on the block itself."""
        return self.attn(self.ln1(x), state)


class ParallelBlock(TransformerBlock):
    """GPT-NeoX's block: attention and MLP both read the block's input (resid_pre), each through its
    own norm. resid_mid is still defined by the identity resid_mid = resid_pre + attn_out, so
    resid_post = resid_mid + mlp_out holds as for a sequential block, but the MLP never sees resid_mid."""

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        attn_out = self.hook_attn_out(self.dropout(self.read_attn(x, state)))
        mlp_out = self.hook_mlp_out(self.dropout(self.mlp(self.ln2(x))))
        return self.hook_resid_post(self.hook_resid_mid(x + attn_out) + mlp_out)


class SandwichBlock(TransformerBlock):
    """Gemma 2/3's block: each sublayer reads a normalised copy of the stream (ln1, ln2) and its output is
    normalised again (ln1_post, ln2_post) before it is added. hook_attn_out and hook_mlp_out are the
    post-norm outputs, exactly what is added to the stream."""

    POST_NORMS = True

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(self.dropout(self.ln1_post(self.read_attn(x, state)))))
        x = self.hook_resid_post(x + self.hook_mlp_out(self.dropout(self.ln2_post(self.mlp(self.ln2(x))))))
        return x


class RescaledSandwichBlock(SandwichBlock):
    """Gemma 4's block: Gemma's sandwich, then the whole stream times the block's stored `layer_scalar`. The
    rescaling is written as one more write to the stream, hook_rescale_out = (layer_scalar - 1) * stream, so
    resid_post = resid_mid + mlp_out + rescale_out and the stream stays a sum of parts.

    E2B and E4B add the block's per-layer input before the rescaling (lenskit.pieces.per_layer): a write of its own,
    hook_per_layer_out, read from hook_per_layer_in, so resid_post = resid_mid + mlp_out + per_layer_out + rescale_out.
    In 26B-A4B the MLP has experts beside it (lenskit.pieces.dense_and_experts), which read the stream itself."""

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """The sandwich block's, and its per-layer write's where there is one; `layer_scalar` is a buffer."""
        own = super().params(cfg, layer)
        return own if cfg.block.d_per_layer is None else summed_counts(own, PerLayerWrite.params(cfg))

    def __init__(self, cfg: ModelConfig, dropout: float = 0.0, layer: int = 0) -> None:
        super().__init__(cfg, dropout, layer)
        self.register_buffer("layer_scalar", torch.ones(1))  # [1], the checkpoint's; a buffer there as here
        if cfg.block.d_per_layer is not None:
            self.per_layer = PerLayerWrite(cfg)
            self.hook_per_layer_in = HookPoint()  # [batch, pos, d_per_layer]
            self.hook_per_layer_out = HookPoint()  # [batch, pos, d_model]
            self.layer = layer  # which slice of the forward's per-layer inputs it reads
        self.hook_rescale_out = HookPoint()  # [batch, pos, d_model]
        # Chosen once: what the MLP reads (with experts: the stream too), and whether a per-layer write follows it.
        self._mlp = self._mlp_with_experts if cfg.block.experts_beside_mlp else self._mlp_alone
        self._late = self._add_per_layer if cfg.block.d_per_layer is not None else _same_stream

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(self.dropout(self.ln1_post(self.read_attn(x, state)))))
        x = self._late(x + self.hook_mlp_out(self.dropout(self.ln2_post(self._mlp(x)))), state)
        return self.hook_resid_post(x + self.hook_rescale_out(x * (self.layer_scalar - 1)))

    def _mlp_alone(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln2(x))

    def _mlp_with_experts(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln2(x), x)

    def _add_per_layer(self, x: torch.Tensor, state: ForwardState | None) -> torch.Tensor:
        """x + the per-layer write, x the stream after the MLP's write [batch, pos, d_model]."""
        what = f"block {self.layer}'s per-layer input"
        per_layer_in = self.hook_per_layer_in(needed(state, what).per_layer_input(self.layer, x))  # [batch, pos, d_per_layer]
        return x + self.hook_per_layer_out(self.dropout(self.per_layer(x, per_layer_in)))


class MambaBesideAttentionBlock(TransformerBlock):
    """Falcon-H1's block: ln1's output feeds attention and a Mamba-2 mixer (lenskit.pieces.mamba2) side by side, and
    their writes, each with its multipliers (the attention's in `cfg.scales`, the mixer's in `cfg.mamba`), are summed
    into the block's one attention-position write, then the MLP reads resid_mid as in a pre-norm block:

        resid_mid = resid_pre + attn_out,   attn_out = heads_out + mamba_out

    hook_heads_out is the attention's write (its heads' `hook_result` sum to it less the output bias), hook_mamba_out
    the mixer's; hook_attn_out, their sum, is exactly what is added to the stream."""

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """The pre-norm block's, and the Mamba-2 mixer's (under `attn`, beside the attention's)."""
        return summed_counts(super().params(cfg, layer), Mamba2Mixer.params(cfg, layer))

    def __init__(self, cfg: ModelConfig, dropout: float = 0.0, layer: int = 0) -> None:
        super().__init__(cfg, dropout, layer)
        self.mamba = Mamba2Mixer(cfg)
        self.hook_heads_out = HookPoint()  # [batch, pos, d_model]
        self.hook_mamba_out = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        normed = self.ln1(x)
        mixed = self.hook_heads_out(self.attn(normed, state)) + self.hook_mamba_out(self.mamba(normed, state))
        x = self.hook_resid_mid(x + self.hook_attn_out(self.dropout(mixed)))
        return self.hook_resid_post(x + self.hook_mlp_out(self.dropout(self.mlp(self.ln2(x)))))


def _same_stream(x: torch.Tensor, state: ForwardState | None) -> torch.Tensor:
    return x


class PostNormBlock(TransformerBlock):
    """OLMo 2's block: each sublayer reads the raw stream and its output is normalised (ln1_post,
    ln2_post) before it is added; there are no norms before the sublayers. hook_attn_out and
    hook_mlp_out are the normalised writes, exactly what is added to the stream."""

    PRE_NORMS, POST_NORMS = False, True

    @classmethod
    def processing_refusal(cls, cfg: ModelConfig, option: str) -> tuple[str, bool] | None:
        """fold_ln has nothing to fold here (lenskit.processing); TransformerLens skips it, final norm included."""
        if option == "fold_ln":
            return (f"fold_ln is not defined for {cfg.family}'s post-norm blocks: no norm sits before a sublayer "
                    "(TransformerLens skips it there, final norm included); pass fold_ln=False", True)
        return None

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(self.dropout(self.ln1_post(self.read_attn(x, state)))))
        x = self.hook_resid_post(x + self.hook_mlp_out(self.dropout(self.ln2_post(self.mlp(x)))))
        return x

    def read_attn(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        return self.attn(x, state)  # no norm before the sublayer


class OneSublayerBlock(TransformerBlock):
    """One of Nemotron-H's layers as a block (`cfg.block.one_sublayer`): a pre-norm token mixer (Mamba-2 or attention,
    `ln1`, `attn`) or a pre-norm MLP (layer type "mlp": `ln2`, `mlp`), never both; the missing half is a
    `lenskit.pieces.absent` piece and writes zeros (`hook_mlp_out` or `hook_attn_out`), so resid_mid = resid_pre +
    attn_out and resid_post = resid_mid + mlp_out hold, and resid_post is the transformers layer's output."""

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """One norm, and what the one sublayer counts."""
        norm_w, norm_b = norm_params(cfg)
        return summed_counts({"norms": (norm_w, norm_b)}, attention_class(cfg, layer).params(cfg, layer),
                             mlp_class(cfg, layer).params(cfg, layer))

    @classmethod
    def processing_refusal(cls, cfg: ModelConfig, option: str) -> tuple[str, bool] | None:
        if option == "fold_ln":
            return f"fold_ln is not implemented for {cfg.family}'s one-sublayer blocks; pass fold_ln=False", False
        return None

    def __init__(self, cfg: ModelConfig, dropout: float = 0.0, layer: int = 0) -> None:
        super().__init__(cfg, dropout, layer)
        mlp_only = cfg.layer_type(layer) == "mlp"
        delattr(self, "ln1" if mlp_only else "ln2")  # the one norm stays, before the half that is there
        self._sublayer = self._mlp_only if mlp_only else self._mixer_only  # chosen once

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        return self._sublayer(x, state)

    def _mixer_only(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(self.dropout(self.read_attn(x, state))))
        return self.hook_resid_post(x + self.hook_mlp_out(torch.zeros_like(x)))

    def _mlp_only(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(torch.zeros_like(x)))
        return self.hook_resid_post(x + self.hook_mlp_out(self.dropout(self.mlp(self.ln2(x)))))


BLOCK_CLASSES = {"pre": TransformerBlock, "sandwich": SandwichBlock, "post": PostNormBlock}


def block_class(cfg: ModelConfig) -> type[TransformerBlock]:
    """The block form the config chooses."""
    if cfg.block.mamba_beside_attention:
        return MambaBesideAttentionBlock
    if cfg.block.one_sublayer:
        return OneSublayerBlock
    return ParallelBlock if cfg.parallel_block else RescaledSandwichBlock if cfg.block.layer_scalar else BLOCK_CLASSES[cfg.norm_placement]


def make_block(cfg: ModelConfig, dropout: float = 0.0, layer: int = 0) -> TransformerBlock:
    """Block `layer` (its index picks its mask and rotary base where the config alternates them)."""
    return block_class(cfg)(cfg, dropout, layer)

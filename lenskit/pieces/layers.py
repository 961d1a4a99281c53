"""The MLPs and the blocks that put the pieces together: sequential (pre-norm, sandwich, post-norm, Gemma 4's sandwich
with a stored scale of the stream) or parallel.

Architecture options are separate classes chosen once from the config (`make_norm` in norms.py,
`Attention`'s pieces in attention.py, `make_mlp` and `make_block` here), so each forward reads
like the maths and has no family branches. A block's MLP is a mixture of experts (moe.py) where the config
makes that block sparse, else one of the dense MLPs here.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .attention import Attention
from .deltanet import GatedDeltaNet
from .forward_state import per_layer_input
from .kv_sharing import SharedKVAttention
from ..observe.hooks import HookPoint
from .linear import Linear
from .moe import MoE
from .norms import LayerNorm, RMSNorm, make_norm, norm_params
from .per_layer import PerLayerWrite

__all__ = ["Attention", "FusedSwiGLU", "GeluMLP", "LayerNorm", "MoE", "ParallelBlock", "PostNormBlock", "RMSNorm", "RescaledSandwichBlock", "SandwichBlock",
           "SwiGLU", "TransformerBlock", "make_block", "make_mlp", "make_norm"]


class MLP(nn.Module):
    """What every MLP piece shows of its weights, as TransformerLens does (`x @ W + b`, the views of
    `model.blocks[l].mlp`): `W_in`, `W_gate` [d_model, d_mlp], `W_out` [d_mlp, d_model], `b_in`, `b_gate`
    [d_mlp], `b_out` [d_model]. `W_in` is the linear (ungated) input; `W_gate` and `b_gate` are None for an
    ungated MLP; an absent bias reads as zeros. The weights are views of the parameters, the zeros are new.

    Each piece says where its input projections are (`_linear_in`, `_gate_in`); the views are written once, here.
    """

    fc_in: nn.Linear
    fc_out: nn.Linear

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Block `layer`'s MLP parameters by accounting row (lenskit.accounting), as (weights, biases)."""
        raise NotImplementedError

    @classmethod
    def active_weights(cls, cfg: ModelConfig, layer: int = 0) -> int:
        """The weights one token's forward multiplies: all of a dense MLP's."""
        return cls.params(cfg, layer)["mlp"][0]

    def norm_readers(self) -> list[nn.Linear]:
        """The projections that read the normalised stream, into which weight processing's fold_ln folds the norm
        before the MLP (lenskit.processing): its input (and gate) projections."""
        raise NotImplementedError

    def _linear_in(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The linear input's weight [d_mlp, d_model] and bias [d_mlp] or None."""
        return self.fc_in.weight, self.fc_in.bias

    def _gate_in(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The gate's weight [d_mlp, d_model] and bias [d_mlp] or None; None for an ungated MLP."""
        return None

    @property
    def W_in(self) -> torch.Tensor:
        return self._linear_in()[0].T

    @property
    def b_in(self) -> torch.Tensor:
        return _or_zeros(*self._linear_in())

    @property
    def W_gate(self) -> torch.Tensor | None:
        gate = self._gate_in()
        return None if gate is None else gate[0].T

    @property
    def b_gate(self) -> torch.Tensor | None:
        gate = self._gate_in()
        return None if gate is None else _or_zeros(*gate)

    @property
    def W_out(self) -> torch.Tensor:
        return self.fc_out.weight.T

    @property
    def b_out(self) -> torch.Tensor:
        return _or_zeros(self.fc_out.weight, self.fc_out.bias)


def _or_zeros(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`bias` [out], or zeros [out] for a layer without one (weight [out, in])."""
    return weight.new_zeros(weight.shape[0]) if bias is None else bias


class GeluMLP(MLP):
    """GPT-2's and GPT-NeoX's MLP: d_model -> d_mlp -> GELU (the config's form) -> d_model. Each MLP piece takes
    its width, `d_mlp` (None: the config's), where a block's differs (`cfg.d_mlp_of`)."""

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        m, d = cfg.d_mlp_of(layer), cfg.d_model
        return {"mlp": (2 * d * m, m + d if cfg.mlp_bias else 0)}  # fc_in, fc_out

    def __init__(self, cfg: ModelConfig, d_mlp: int | None = None) -> None:
        super().__init__()
        d_mlp = cfg.d_mlp if d_mlp is None else d_mlp
        self.approximate = cfg.gelu_approximate
        self.fc_in = Linear(cfg.d_model, d_mlp, bias=cfg.mlp_bias)
        self.fc_out = Linear(d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def norm_readers(self) -> list[nn.Linear]:
        return [self.fc_in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.fc_in(x))
        post = self.hook_post(F.gelu(pre, approximate=self.approximate))
        return self.fc_out(post)


class SwiGLU(MLP):
    """Gated MLP: fc_out(act(gate(x)) * fc_in(x)), biases only where the config has them (Llama's `mlp_bias`).
    act is SiLU, or for mlp="geglu" (Gemma) the config's GELU."""

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        m, d = cfg.d_mlp_of(layer), cfg.d_model
        return {"mlp": (3 * d * m, 2 * m + d if cfg.mlp_bias else 0)}  # gate, fc_in, fc_out

    def __init__(self, cfg: ModelConfig, d_mlp: int | None = None) -> None:
        super().__init__()
        d_mlp = cfg.d_mlp if d_mlp is None else d_mlp
        self.act = F.silu if cfg.mlp.startswith("swiglu") else partial(F.gelu, approximate=cfg.gelu_approximate)
        self.gate = Linear(cfg.d_model, d_mlp, bias=cfg.mlp_bias)
        self.fc_in = Linear(cfg.d_model, d_mlp, bias=cfg.mlp_bias)
        self.fc_out = Linear(d_mlp, cfg.d_model, bias=cfg.mlp_bias)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp], the gate's pre-activation
        self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def norm_readers(self) -> list[nn.Linear]:
        return [self.gate, self.fc_in]  # with experts beside it (DenseAndExperts), they read the stream itself

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.gate(x))
        linear = self.hook_pre_linear(self.fc_in(x))
        return self.fc_out(self.hook_post(self.act(pre) * linear))

    def _gate_in(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.gate.weight, self.gate.bias


class FusedSwiGLU(SwiGLU):
    """SwiGLU whose gate and up projections are one matrix `gate_up`, [gate rows | up rows] (Phi-3),
    kept as the checkpoint stores it. Same hooks and weight views as SwiGLU (`W_gate`, `W_in` are its halves)."""

    def __init__(self, cfg: ModelConfig, d_mlp: int | None = None) -> None:
        super().__init__(cfg, d_mlp)
        del self.gate, self.fc_in
        self.gate_up = Linear(cfg.d_model, 2 * self.fc_out.in_features, bias=cfg.mlp_bias)

    def norm_readers(self) -> list[nn.Linear]:
        return [self.gate_up]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, linear = self.gate_up(x).chunk(2, dim=-1)
        pre, linear = self.hook_pre(gate), self.hook_pre_linear(linear)
        return self.fc_out(self.hook_post(self.act(pre) * linear))

    def _linear_in(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._half(1)

    def _gate_in(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._half(0)

    def _half(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """gate_up's gate (0) or up (1) rows [d_mlp, d_model] and bias, as forward splits its output."""
        bias = self.gate_up.bias
        return self.gate_up.weight.chunk(2, dim=0)[i], None if bias is None else bias.chunk(2)[i]


MLP_CLASSES = {"gelu": GeluMLP, "swiglu": SwiGLU, "geglu": SwiGLU, "swiglu_fused": FusedSwiGLU}


def mlp_class(cfg: ModelConfig, layer: int = 0) -> type[MLP] | type[MoE]:
    """The piece of block `layer`'s MLP: a mixture of experts where the config makes that block sparse, the dense MLP
    with experts beside it (Gemma 4 26B-A4B), else the dense MLP."""
    if cfg.experts_beside_mlp:
        from .dense_and_experts import DenseAndExperts  # it builds on SwiGLU, so it imports this module

        return DenseAndExperts
    return MoE if cfg.is_moe_layer(layer) else MLP_CLASSES[cfg.mlp]


def make_mlp(cfg: ModelConfig, layer: int = 0) -> MLP | MoE:
    """Block `layer`'s MLP (`mlp_class`), a dense one `cfg.d_mlp_of(layer)` wide."""
    cls = mlp_class(cfg, layer)
    return cls(cfg) if cls is MoE else cls(cfg, cfg.d_mlp_of(layer))


def attention_class(cfg: ModelConfig, layer: int = 0) -> type[Attention] | type[GatedDeltaNet]:
    """The piece of block `layer`'s token mixer: softmax attention (with an earlier block's keys and values where it
    shares them, `cfg.kv_source`), or linear attention where the config makes that block linear."""
    if cfg.layer_type(layer) == "linear":
        return GatedDeltaNet
    return SharedKVAttention if cfg.kv_source(layer) is not None else Attention


def make_attention(cfg: ModelConfig, layer: int = 0) -> Attention | GatedDeltaNet:
    """Block `layer`'s token mixer (`attention_class`)."""
    cls = attention_class(cfg, layer)
    return cls(cfg) if cls is GatedDeltaNet else cls(cfg, layer)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(self.dropout(self.read_attn(x))))
        x = self.hook_resid_post(x + self.hook_mlp_out(self.dropout(self.mlp(self.ln2(x)))))
        return x

    def read_attn(self, x: torch.Tensor) -> torch.Tensor:
        """The attention's write [batch, pos, d_model] from the stream: attn(ln1(x)). TransformerLens's per-head input
        switches (lenskit.observe.switches) replace this reading, once, on the block itself."""
        return self.attn(self.ln1(x))


class ParallelBlock(TransformerBlock):
    """GPT-NeoX's block: attention and MLP both read the block's input (resid_pre), each through its
    own norm. resid_mid is still defined by the identity resid_mid = resid_pre + attn_out, so
    resid_post = resid_mid + mlp_out holds as for a sequential block, but the MLP never sees resid_mid."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        attn_out = self.hook_attn_out(self.dropout(self.read_attn(x)))
        mlp_out = self.hook_mlp_out(self.dropout(self.mlp(self.ln2(x))))
        return self.hook_resid_post(self.hook_resid_mid(x + attn_out) + mlp_out)


class SandwichBlock(TransformerBlock):
    """Gemma 2/3's block: each sublayer reads a normalised copy of the stream (ln1, ln2) and its output is
    normalised again (ln1_post, ln2_post) before it is added. hook_attn_out and hook_mlp_out are the
    post-norm outputs, exactly what is added to the stream."""

    POST_NORMS = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(self.dropout(self.ln1_post(self.read_attn(x)))))
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
        return own if cfg.d_per_layer is None else summed_counts(own, PerLayerWrite.params(cfg))

    def __init__(self, cfg: ModelConfig, dropout: float = 0.0, layer: int = 0) -> None:
        super().__init__(cfg, dropout, layer)
        self.register_buffer("layer_scalar", torch.ones(1))  # [1], the checkpoint's; a buffer there as here
        if cfg.d_per_layer is not None:
            self.per_layer = PerLayerWrite(cfg)
            self.hook_per_layer_in = HookPoint()  # [batch, pos, d_per_layer]
            self.hook_per_layer_out = HookPoint()  # [batch, pos, d_model]
            self._per_layer_input = partial(per_layer_input, layer)
        self.hook_rescale_out = HookPoint()  # [batch, pos, d_model]
        # Chosen once: what the MLP reads (with experts: the stream too), and whether a per-layer write follows it.
        self._mlp = self._mlp_with_experts if cfg.experts_beside_mlp else self._mlp_alone
        self._late = self._add_per_layer if cfg.d_per_layer is not None else _same_stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(self.dropout(self.ln1_post(self.read_attn(x)))))
        x = self._late(x + self.hook_mlp_out(self.dropout(self.ln2_post(self._mlp(x)))))
        return self.hook_resid_post(x + self.hook_rescale_out(x * (self.layer_scalar - 1)))

    def _mlp_alone(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln2(x))

    def _mlp_with_experts(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln2(x), x)

    def _add_per_layer(self, x: torch.Tensor) -> torch.Tensor:
        """x + the per-layer write, x the stream after the MLP's write [batch, pos, d_model]."""
        per_layer_in = self.hook_per_layer_in(self._per_layer_input(x))  # [batch, pos, d_per_layer]
        return x + self.hook_per_layer_out(self.dropout(self.per_layer(x, per_layer_in)))


def _same_stream(x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(self.dropout(self.ln1_post(self.read_attn(x)))))
        x = self.hook_resid_post(x + self.hook_mlp_out(self.dropout(self.ln2_post(self.mlp(x)))))
        return x

    def read_attn(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)  # no norm before the sublayer


BLOCK_CLASSES = {"pre": TransformerBlock, "sandwich": SandwichBlock, "post": PostNormBlock}


def block_class(cfg: ModelConfig) -> type[TransformerBlock]:
    """The block form the config chooses."""
    return ParallelBlock if cfg.parallel_block else RescaledSandwichBlock if cfg.layer_scalar else BLOCK_CLASSES[cfg.norm_placement]


def make_block(cfg: ModelConfig, dropout: float = 0.0, layer: int = 0) -> TransformerBlock:
    """Block `layer` (its index picks its mask and rotary base where the config alternates them)."""
    return block_class(cfg)(cfg, dropout, layer)

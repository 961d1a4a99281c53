"""The dense MLPs, each a separate class chosen once from the config (`cfg.mlp`, `MLP_CLASSES`): GPT-2's GELU MLP
(or ReLU, squared ReLU, or Apertus's learned xIELU, `XIELU`), the gated SwiGLU / GeGLU, and Phi-3's with a fused gate and input
projection. `lenskit.pieces.layers.make_mlp`
picks one for each block (or a mixture of experts, lenskit.pieces.moe)."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint
from .linear import Linear, write_projection, written


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
        return written(self.fc_out, self.fc_out.weight.T)  # times the residual scale where the write has one

    @property
    def b_out(self) -> torch.Tensor:
        return written(self.fc_out, _or_zeros(self.fc_out.weight, self.fc_out.bias))


def _or_zeros(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`bias` [out], or zeros [out] for a layer without one (weight [out, in])."""
    return weight.new_zeros(weight.shape[0]) if bias is None else bias


class XIELU(nn.Module):
    """xIELU (Huang et al., 2024, arXiv:2411.13010), Apertus's activation, with two learned scalars per MLP:
    x > 0: a_p x^2 + beta x; else a_n (expm1(min(x, eps)) - x) + beta x, where a_p = softplus(alpha_p) and
    a_n = beta + softplus(alpha_n). `alpha_p`, `alpha_n` [1] are parameters and `beta`, `eps` [] buffers, under
    the names (and with the initial values) of transformers' `XIELUActivation`, whose checkpoints store all four;
    its torch path is the reference (its optional CUDA kernel, the `xielu` package, is not compared here)."""

    PARAMS = 2  # alpha_p, alpha_n; beta and eps are buffers, as in transformers

    def __init__(self, alpha_p: float = 0.8, alpha_n: float = 0.8, beta: float = 0.5, eps: float = -1e-6) -> None:
        super().__init__()
        self.init = (alpha_p, alpha_n - beta)  # what softplus(alpha_p) and softplus(alpha_n) start at
        self.alpha_p = nn.Parameter(torch.empty(1))
        self.alpha_n = nn.Parameter(torch.empty(1))
        self.register_buffer("beta", torch.tensor(beta))
        self.register_buffer("eps", torch.tensor(eps))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """a_p and a_n back at their initial values: the scalars are softplus^-1 of them (less beta for a_n)."""
        with torch.no_grad():
            for p, start in zip((self.alpha_p, self.alpha_n), self.init):
                p.copy_(torch.log(torch.expm1(torch.tensor([start], dtype=p.dtype, device=p.device))))  # as transformers rounds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a_p = F.softplus(self.alpha_p)
        a_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, a_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * a_n + self.beta * x)


def _relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def activation(cfg: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ungated MLP's activation the config names (a module where it has parameters: xIELU)."""
    if cfg.activation == "relu":
        return F.relu
    if cfg.activation == "relu2":
        return _relu_squared
    if cfg.activation == "xielu":
        return XIELU()
    return partial(F.gelu, approximate=cfg.gelu_approximate)


class GeluMLP(MLP):
    """GPT-2's and GPT-NeoX's MLP: d_model -> d_mlp -> the config's activation (a GELU form, ReLU, Nemotron-H's
    squared ReLU, or Apertus's xIELU with its two learned scalars) -> d_model.
    Each MLP piece takes its width, `d_mlp` (None: the config's), where a block's differs (`cfg.d_mlp_of`)."""

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        m, d = cfg.d_mlp_of(layer), cfg.d_model
        learned = XIELU.PARAMS if cfg.activation == "xielu" else 0  # scalars, counted with the biases: no matmul
        return {"mlp": (2 * d * m, (m + d if cfg.mlp_bias else 0) + learned)}  # fc_in, fc_out

    def __init__(self, cfg: ModelConfig, d_mlp: int | None = None) -> None:
        super().__init__()
        d_mlp = cfg.d_mlp if d_mlp is None else d_mlp
        self.act = activation(cfg)
        self.fc_in = Linear(cfg.d_model, d_mlp, bias=cfg.mlp_bias)
        self.fc_out = write_projection(d_mlp, cfg.d_model, cfg.mlp_bias, cfg.scales.residual)
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def norm_readers(self) -> list[nn.Linear]:
        return [self.fc_in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.fc_in(x))
        post = self.hook_post(self.act(pre))
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
        # the write's multipliers (Granite's residual, Falcon-H1's mlp_down) are the output projection's scale
        self.fc_out = write_projection(d_mlp, cfg.d_model, cfg.mlp_bias, cfg.scales.residual * cfg.scales.mlp_down)
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


class ScaledSwiGLU(SwiGLU):
    """SwiGLU under Falcon-H1's gate multiplier (`cfg.scales.mlp_gate`): the gate's pre-activation times it (hook_pre
    shows the product). The weight views carry the factor (copies), so `x @ W_gate` is hook_pre. Its write multiplier
    (`mlp_down`) is SwiGLU's output projection's scale, as every write's is (lenskit.pieces.linear.ScaledLinear)."""

    def __init__(self, cfg: ModelConfig, d_mlp: int | None = None) -> None:
        super().__init__(cfg, d_mlp)
        self.gate_multiplier = cfg.scales.mlp_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.hook_pre(self.gate(x) * self.gate_multiplier)
        linear = self.hook_pre_linear(self.fc_in(x))
        return self.fc_out(self.hook_post(self.act(pre) * linear))

    def _gate_in(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = self.gate.bias
        return self.gate.weight * self.gate_multiplier, None if bias is None else bias * self.gate_multiplier


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

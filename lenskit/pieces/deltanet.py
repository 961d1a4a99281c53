"""Gated DeltaNet: the linear-attention layer of Qwen 3.5 (three blocks in four), written out in torch.

Per value head, a state S [d_k, d_v] is decayed, corrected toward the new key's value and read by the query:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        o_t = S_t^T q_t / sqrt(d_k)

q and k are the L2-normalised outputs of a causal depthwise convolution (then SiLU) over one projection of the
stream; beta = sigmoid(b) is the write strength and g = -exp(A_log) softplus(a + dt_bias) <= 0 the log decay.
The output is RMS-normalised per head, gated by SiLU(z) and projected back to d_model.

`chunked_gated_delta_rule` (the default, for prompts) computes the same recurrence a chunk of positions at a time
(the WY/UT form: one triangular solve per chunk, then a scan over chunks), so its cost and memory are linear in
the prompt length; `recurrent_gated_delta_rule` is the plain recurrence, the reference the tests compare it to.
Both run in float32, as transformers does, and return the outputs and the state after the last position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint
from .forward_state import ForwardState
from .linear import Linear

CHUNK = 64  # positions per chunk: transformers' and the fla kernels' size


def _prepared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rule's inputs in float32, heads first: q, k L2-normalised (q also scaled by d_k ** -0.5) and repeated
    so that each k head serves n_v / n_k consecutive value heads. q, k [batch, pos, k_head, d_k], v [batch, pos,
    v_head, d_v], beta and g [batch, pos, v_head] -> q, k [batch, v_head, pos, d_k], v [batch, v_head, pos, d_v],
    beta, g [batch, v_head, pos]."""
    group = v.shape[2] // k.shape[2]
    q, k = (x.float().repeat_interleave(group, dim=2) if group > 1 else x.float() for x in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5  # eps 1e-6 as fla's l2norm
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return tuple(x.transpose(1, 2).float().contiguous() for x in (q, k, v, beta, g))


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                               g: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain recurrence, one position at a time (shapes as in `chunked_gated_delta_rule`)."""
    q, k, v, beta, g = _prepared(q, k, v, beta, g)
    batch, heads, pos, d_k = k.shape
    state = v.new_zeros(batch, heads, d_k, v.shape[-1]) if state is None else state.float()  # [batch, v_head, d_k, d_v]
    out = torch.empty_like(v)
    for t in range(pos):
        state = state * g[:, :, t, None, None].exp()
        seen = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])  # what the decayed state predicts for k_t
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, :, t], (v[:, :, t] - seen) * beta[:, :, t, None])
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, :, t])
    return out.transpose(1, 2), state


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                             chunk: int = CHUNK, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule a chunk at a time: q, k [batch, pos, k_head, d_k], v [batch, pos, v_head, d_v],
    beta, g [batch, pos, v_head] -> outputs [batch, pos, v_head, d_v] (float32) and the state after the last
    position [batch, v_head, d_k, d_v]. `state` is the one before the first position (None: zeros, a fresh start).

    Within a chunk starting from state S, with c_i the cumulative log decay up to position i, the corrections
    w_i = beta_i (v_i - exp(g_i) S_{i-1}^T k_i) solve the unit lower-triangular system (I + L) W = V_beta - K_beta
    exp(c) S, L_ij = beta_i exp(c_i - c_j) k_i.k_j for j < i; then O = exp(c) Q S + (Q K^T * decay, j <= i) W and
    the next state is exp(c_last) S + (K exp(c_last - c))^T W. The prompt is padded at the end to whole chunks with
    positions that neither decay (g = 0) nor write (k = 0)."""
    pos = q.shape[1]
    q, k, v, beta, g = _prepared(q, k, v, beta, g)
    pad = -pos % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    batch, heads, total, d_k = k.shape
    n = total // chunk
    q, k, v = (x.view(batch, heads, n, chunk, -1) for x in (q, k, v))  # [batch, v_head, chunk_index, chunk, d]
    beta, g = beta.view(batch, heads, n, chunk), g.view(batch, heads, n, chunk)
    c = g.cumsum(-1)  # [batch, v_head, chunk_index, chunk]
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)  # key after query
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(later, float("-inf")).exp()  # [..., chunk, chunk], j <= i
    k_beta = k * beta[..., None]
    lower = k_beta @ k.transpose(-1, -2) * decay  # L below the diagonal; the solve reads nothing else
    solve = lambda rhs: torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)  # noqa: E731
    u, k_read = solve(v * beta[..., None]), solve(k_beta * c.exp()[..., None])  # W = u - k_read S
    attn = q @ k.transpose(-1, -2) * decay  # [..., chunk, chunk]
    q_read = q * c.exp()[..., None]  # queries reading the chunk's starting state
    k_write = k * (c[..., -1:] - c).exp()[..., None]  # keys as they reach the chunk's end
    carry = c[..., -1].exp()[..., None, None]  # [batch, v_head, chunk_index, 1, 1]
    state = v.new_zeros(batch, heads, d_k, v.shape[-1]) if state is None else state.float()  # [batch, v_head, d_k, d_v]
    out = torch.empty_like(v)
    for i in range(n):
        w = u[:, :, i] - k_read[:, :, i] @ state  # [batch, v_head, chunk, d_v]
        out[:, :, i] = q_read[:, :, i] @ state + attn[:, :, i] @ w
        state = state * carry[:, :, i] + k_write[:, :, i].transpose(-1, -2) @ w
    return out.view(batch, heads, total, -1)[:, :, :pos].transpose(1, 2), state


def causal_conv(x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU of a causal depthwise convolution along positions: x [batch, pos, channel], weight [channel, 1, width],
    bias [channel] or None; position t sees positions t - width + 1 .. t, with zeros before the prompt (a fresh state),
    or after `past` [batch, width - 1, channel], the inputs just before x (a carried state)."""
    if past is not None:
        return causal_conv(torch.cat([past.to(x.dtype), x], dim=1), weight, bias=bias)[:, past.shape[1]:]
    width = weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, bias, padding=width - 1, groups=x.shape[-1])  # [batch, channel, pos + width - 1]
    return F.silu(y[..., : x.shape[1]]).transpose(1, 2).to(x.dtype)  # [batch, pos, channel]


class GatedRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight * SiLU(gate), over each head's d_v, in float32 as transformers runs it."""

    IDENTITY_WEIGHT = 1.0

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer (`cfg.layer_type(l) == "linear"`), in the block where attention would be (`attn`).

    Hooks: `hook_q`, `hook_k` [batch, pos, k_head, d_k] and `hook_v` [batch, pos, v_head, d_v] (the convolution's
    outputs; the rule L2-normalises q and k), the gates `hook_beta` and `hook_g` [batch, pos, v_head] (write
    strength in (0, 1) and log decay <= 0), `hook_z` [batch, pos, v_head, d_v] (each head's gated, normalised
    output, what `out_proj` reads) and, on request, `hook_state` [batch, v_head, d_k, d_v], the state after the
    last position (it only observes: nothing downstream reads it). There are no attention scores or pattern.
    """

    LAYER_TYPE = "linear-attention (Gated DeltaNet)"
    NO_HOOKS = ("hook_attn_scores", "hook_pattern", "hook_rot_q", "hook_rot_k", "hook_result")  # attention's, not here
    # The prompt form; the reference, recurrent_gated_delta_rule, computes the same (a test sets it per instance).
    rule = staticmethod(chunked_gated_delta_rule)

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Its parameters by accounting row (lenskit.accounting), as (weights, biases): the projections in_qkv, in_z,
        in_b, in_a, the depthwise causal convolution and out_proj under `attn`, with A_log and dt_bias (one per value
        head) as biases; its gated output norm's gain under `norms`."""
        d, n_v = cfg.d_model, cfg.linear.n_v_heads
        k_dim, v_dim = cfg.linear.n_k_heads * cfg.linear.d_k, n_v * cfg.linear.d_v
        weights = d * (2 * k_dim + 2 * v_dim + 2 * n_v) + (2 * k_dim + v_dim) * cfg.linear.conv_width + v_dim * d
        return {"attn": (weights, 2 * n_v), "norms": (cfg.linear.d_v, 0)}

    @classmethod
    def processing_refusal(cls, cfg: ModelConfig, option: str) -> tuple[str, bool] | None:
        """Why weight processing's `option` cannot be applied to linear-attention blocks (lenskit.processing)."""
        if option == "refactor_factored_attn_matrices":
            return (f"refactor_factored_attn_matrices is not defined for {cfg.family}: its heads are gated or linear; "
                    "pass refactor_factored_attn_matrices=False", False)
        if option == "fold_ln":
            return f"fold_ln is not implemented for {cfg.family}'s linear-attention blocks; pass fold_ln=False", False
        if option == "fold_value_biases":
            return (f"fold_value_biases is not defined for {cfg.family}'s linear-attention blocks; "
                    "pass fold_value_biases=False", False)
        return None

    @classmethod
    def core_flops(cls, cfg: ModelConfig, layer: int, n_keys: float) -> dict[str, float]:
        """The delta rule's FLOPs per token, whatever the context: per value head the state's read of k, its rank-one
        update and its read of q, 6 d_k d_v."""
        return {"linear_core": 6 * cfg.linear.n_v_heads * cfg.linear.d_k * cfg.linear.d_v}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_k_heads, self.n_v_heads = cfg.linear.n_k_heads, cfg.linear.n_v_heads
        self.d_k, self.d_v = cfg.linear.d_k, cfg.linear.d_v
        self.sizes = (self.n_k_heads * self.d_k, self.n_k_heads * self.d_k, self.n_v_heads * self.d_v)
        self.in_qkv = Linear(cfg.d_model, sum(self.sizes), bias=False)
        self.in_z = Linear(cfg.d_model, self.n_v_heads * self.d_v, bias=False)
        self.in_b = Linear(cfg.d_model, self.n_v_heads, bias=False)
        self.in_a = Linear(cfg.d_model, self.n_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(sum(self.sizes), 1, cfg.linear.conv_width))  # [channel, 1, width]
        self.A_log = nn.Parameter(torch.zeros(self.n_v_heads))  # [v_head]: the decay rate is exp(A_log)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v_heads))  # [v_head]
        self.out_norm = GatedRMSNorm(self.d_v, cfg.norm_eps)
        self.out_proj = Linear(self.n_v_heads * self.d_v, cfg.d_model, bias=False)
        self.hook_q = HookPoint()  # [batch, pos, k_head, d_k]
        self.hook_k = HookPoint()  # [batch, pos, k_head, d_k]
        self.hook_v = HookPoint()  # [batch, pos, v_head, d_v]
        self.hook_beta = HookPoint()  # [batch, pos, v_head]
        self.hook_g = HookPoint()  # [batch, pos, v_head], float32
        self.hook_state = HookPoint()  # [batch, v_head, d_k, d_v], float32, computed only when hooked
        self.hook_z = HookPoint()  # [batch, pos, v_head, d_v]

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        """The block's write [batch, pos, d_model] from its normed stream x, with the forward's `state`
        (lenskit.pieces.forward_state: its KV cache entry; None for a block alone, which has no cache)."""
        batch, pos, _ = x.shape
        past = None if state is None else state.entry(self)  # lenskit.kv_cache: None unless given past_kv_cache
        mixed = self.in_qkv(x)  # [batch, pos, channel]
        q, k, v = causal_conv(mixed, self.conv_weight, None if past is None else past.conv).split(self.sizes, dim=-1)
        q = self.hook_q(q.view(batch, pos, self.n_k_heads, self.d_k))
        k = self.hook_k(k.view(batch, pos, self.n_k_heads, self.d_k))
        v = self.hook_v(v.view(batch, pos, self.n_v_heads, self.d_v))
        beta = self.hook_beta(self.in_b(x).sigmoid())  # [batch, pos, v_head]
        g = self.hook_g(-self.A_log.float().exp() * F.softplus(self.in_a(x).float() + self.dt_bias))  # [batch, pos, v_head]
        if past is None or past.state is None:
            out, recurrent = self.rule(q, k, v, beta, g)  # [batch, pos, v_head, d_v], [batch, v_head, d_k, d_v]
        else:  # on from the carried state, by the recurrence: a chunk would pad a one-position step to 64
            out, recurrent = recurrent_gated_delta_rule(q, k, v, beta, g, past.state)
        if past is not None:
            past.update(mixed, self.conv_weight.shape[-1], recurrent)
        if self.hook_state.has_hooks():
            self.hook_state(recurrent)
        gate = self.in_z(x).view(batch, pos, self.n_v_heads, self.d_v)
        z = self.hook_z(self.out_norm(out.to(x.dtype), gate))  # [batch, pos, v_head, d_v]
        return self.out_proj(z.reshape(batch, pos, -1))

    def extra_repr(self) -> str:
        return (f"k_heads={self.n_k_heads}, v_heads={self.n_v_heads}, d_k={self.d_k}, d_v={self.d_v}, "
                f"conv_width={self.conv_weight.shape[-1]}")

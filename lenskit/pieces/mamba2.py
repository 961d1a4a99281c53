"""The Mamba-2 mixer (Nemotron-H, Granite 4, Falcon-H1), written out in torch.

Per head h (its width d_head = P) a state S [P, N] decays by exp(dt_t A_h) <= 1 and takes the write dt_t x_t B_t^T;
the head's output reads it with C_t and adds a skip D_h x_t:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T        y_t = S_t C_t + D_h x_t

One projection of the stream gives the gate z, the SSM input x with B and C (the group of heads' input and output
maps, N = d_state wide, each of n_groups shared by n_heads / n_groups consecutive heads) and the raw step dt. x, B and
C pass a causal depthwise convolution then SiLU; dt = clamp(softplus(dt + dt_bias), dt_min, dt_max) and
A = -exp(A_log). y meets the gate in a gated RMSNorm (its three forms: `lenskit.config_checks.MAMBA_NORMS`) and is
projected back to d_model.

`chunked_scan` (the default, for prompts; state space duality as in transformers' torch path) computes the recurrence
`cfg.mamba.chunk_size` positions at a time: within a chunk the outputs are a masked, decaying product (C B^T) x, and
one state per chunk carries the past across chunks, so cost and memory are linear in the prompt. `recurrent_scan` is
the plain recurrence: generation steps from a carried state with it, and the tests take it as the reference. Both run
in float32, as transformers does.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..observe.hooks import HookPoint
from .deltanet import causal_conv
from .forward_state import ForwardState
from .linear import Linear, write_projection


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C [batch, pos, group, d_state] -> [batch, pos, head, d_state] in float32, group g serving heads
    g * heads / group .. (g + 1) * heads / group - 1."""
    rep = heads // t.shape[2]
    return t.float().repeat_interleave(rep, dim=2) if rep > 1 else t.float()


def recurrent_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain recurrence, one position at a time (shapes as in `chunked_scan`)."""
    batch, pos, heads, d_head = x.shape
    x, dt, A = x.float(), dt.float(), A.float()
    B, C = _per_head(B, heads), _per_head(C, heads)  # [batch, pos, head, d_state]
    state = x.new_zeros(batch, heads, d_head, B.shape[-1]) if state is None else state.float()  # [batch, head, d_head, d_state]
    out = x.new_empty(batch, pos, heads, d_head)
    for t in range(pos):
        step = dt[:, t, :, None]  # [batch, head, 1]
        state = state * (step * A[:, None]).exp()[..., None] + (step * x[:, t])[..., None] * B[:, t, :, None]
        out[:, t] = (state @ C[:, t, :, :, None])[..., 0]
    return out, state


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., chunk] -> [..., chunk (i), chunk (j)]: the sum of a over positions j < k <= i, -inf where j > i.
    Summed directly rather than as a difference of running sums, which loses the small decays of a long chunk."""
    n = a.shape[-1]
    below = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1)  # k > j, as [k, j]
    sums = a[..., :, None].expand(*a.shape, n).masked_fill(~below, 0).cumsum(-2)  # [..., i, j]
    return sums.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=a.device).tril(), float("-inf"))


def chunked_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 state: torch.Tensor | None = None, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 recurrence a chunk at a time: x [batch, pos, head, d_head], dt [batch, pos, head] (the step sizes),
    A [head] (< 0), B, C [batch, pos, group, d_state] -> outputs y [batch, pos, head, d_head] (float32, without the
    D skip) and the state after the last position [batch, head, d_head, d_state]. `state` is the one before the first
    position (None: zeros, a fresh start).

    Within a chunk starting from state S, with a_i = dt_i A the log decays and c_i their running sum, position i
    reads y_i = exp(c_i) S C_i + sum_{j <= i} exp(c_i - c_j) (C_i . B_j) dt_j x_j, and the next chunk starts from
    exp(c_last) S + sum_j exp(c_last - c_j) dt_j x_j B_j^T. The prompt is padded at the end to whole chunks with
    positions that neither decay nor write (dt = 0)."""
    batch, pos, heads, d_head = x.shape
    groups, d_state = B.shape[2], B.shape[3]
    rep = heads // groups
    pad = -pos % chunk
    n = (pos + pad) // chunk
    x, B, C = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
    dt = F.pad(dt.float(), (0, 0, 0, pad))
    # heads as [group, rep]: B and C stay one per group, broadcast over the group's heads
    x = x.view(batch, n, chunk, groups, rep, d_head).permute(0, 3, 4, 1, 2, 5)  # [batch, group, rep, n, chunk, d_head]
    B, C = (t.view(batch, n, chunk, groups, 1, d_state).permute(0, 3, 4, 1, 2, 5) for t in (B, C))  # [batch, group, 1, n, chunk, d_state]
    dt = dt.view(batch, n, chunk, groups, rep).permute(0, 3, 4, 1, 2)  # [batch, group, rep, n, chunk]
    a = dt * A.float().view(groups, rep, 1, 1)
    c = a.cumsum(-1)
    xdt = x * dt[..., None]
    # inside each chunk: a causal, decaying mix of the chunk's own writes
    out = (C @ B.transpose(-1, -2) * _segment_sums(a).exp()) @ xdt  # [batch, group, rep, n, chunk, d_head]
    writes = (xdt * (c[..., -1:] - c).exp()[..., None]).transpose(-1, -2) @ B  # [batch, group, rep, n, d_head, d_state]
    reads = c.exp()[..., None]  # [batch, group, rep, n, chunk, 1]: how much of the chunk's starting state each position sees
    carry = c[..., -1].exp()[..., None, None]  # [batch, group, rep, n, 1, 1]
    state = x.new_zeros(batch, heads, d_head, d_state) if state is None else state.float()
    state = state.view(batch, groups, rep, d_head, d_state)
    for i in range(n):
        out[:, :, :, i] += (C[:, :, :, i] @ state.transpose(-1, -2)) * reads[:, :, :, i]
        state = state * carry[:, :, :, i] + writes[:, :, :, i]
    out = out.permute(0, 3, 4, 1, 2, 5).reshape(batch, n * chunk, heads, d_head)[:, :pos]
    return out, state.reshape(batch, heads, d_head, d_state)


def _grouped_rms(h: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """h [..., d_inner] (float32) RMS-normalised over each of `groups` equal slices of its last axis."""
    sliced = h.view(*h.shape[:-1], groups, -1)
    return (sliced * torch.rsqrt(sliced.pow(2).mean(-1, keepdim=True) + eps)).view(h.shape)


class GateThenNorm(nn.Module):
    """RMSNorm(y * SiLU(z)) per group, times the gain: Nemotron-H's, Granite 4's, Falcon-H1's norm_before_gate=False."""

    IDENTITY_WEIGHT = 1.0

    def __init__(self, d_inner: int, groups: int, eps: float) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(d_inner))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z [batch, pos, d_inner] -> [batch, pos, d_inner], float32."""
        return self.weight.float() * _grouped_rms(y.float() * F.silu(z.float()), self.groups, self.eps)


class NormThenGate(GateThenNorm):
    """RMSNorm(y) per group, times the gain, times SiLU(z): Falcon-H1's norm_before_gate=True."""

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.weight.float() * _grouped_rms(y.float(), self.groups, self.eps) * F.silu(z.float())


class GateOnly(nn.Module):
    """y * SiLU(z), no norm: Falcon-H1's mamba_rms_norm=False."""

    def __init__(self, d_inner: int, groups: int, eps: float) -> None:
        super().__init__()

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return y.float() * F.silu(z.float())


GATED_NORMS = {"gate_then_norm": GateThenNorm, "norm_then_gate": NormThenGate, "gate_only": GateOnly}


class Mamba2Mixer(nn.Module):
    """A Mamba-2 mixer (`cfg.layer_type(l) == "mamba"`), in the block where attention would be (`attn`).

    Hooks: `hook_in_proj` [batch, pos, 2 d_inner + 2 n_groups d_state + head] (z | x B C | dt, after any multipliers),
    `hook_conv` [batch, pos, d_inner + 2 n_groups d_state] (x B C after the convolution and SiLU), `hook_B`, `hook_C`
    [batch, pos, group, d_state], `hook_dt` [batch, pos, head] (the step sizes, float32), `hook_ssm_out` [batch, pos,
    head, d_head] (y, the scan's output with the D skip, float32), `hook_gate` [batch, pos, head, d_head] (z before its
    SiLU) and, on request, `hook_state` [batch, head, d_head, d_state], the state after the last position (it only
    observes: nothing downstream reads it). There are no attention scores, pattern or per-head writes to the stream
    (the gated norm mixes the heads of a group before out_proj).
    """

    LAYER_TYPE = "Mamba-2"
    NO_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_z", "hook_attn_scores", "hook_pattern", "hook_rot_q", "hook_rot_k",
                "hook_result")  # attention's, not here

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        """Its parameters by accounting row (lenskit.accounting), as (weights, biases): in_proj, the depthwise causal
        convolution and out_proj under `attn`, with their biases and A_log, dt_bias and D (one per head) as biases;
        its gated norm's gain (where it has one) under `norms`."""
        m, d = cfg.mamba, cfg.d_model
        d_inner, conv_dim = m.n_heads * m.d_head, m.n_heads * m.d_head + 2 * m.n_groups * m.d_state
        d_in_proj = d_inner + conv_dim + m.n_heads
        weights = d * d_in_proj + conv_dim * m.conv_width + d_inner * d
        biases = 3 * m.n_heads + d_in_proj * m.in_bias + conv_dim * m.conv_bias + d * m.out_bias
        return {"attn": (weights, biases), "norms": (0 if m.norm == "gate_only" else d_inner, 0)}

    @classmethod
    def core_flops(cls, cfg: ModelConfig, layer: int, n_keys: float) -> dict[str, float]:
        """The scan's FLOPs per token, whatever the context: per head the state's decay (P N), its rank-one write
        (2 P N) and its read by C (2 P N), 5 d_head d_state, as the recurrence computes it (the chunked form computes
        the same function)."""
        m = cfg.mamba
        return {"linear_core": 5 * m.n_heads * m.d_head * m.d_state}

    @classmethod
    def processing_refusal(cls, cfg: ModelConfig, option: str) -> tuple[str, bool] | None:
        """Why weight processing's `option` cannot be applied to Mamba-2 blocks (lenskit.processing): it has no
        attention heads to refactor, no value biases to fold, and fold_ln is not implemented for its in_proj."""
        if option == "refactor_factored_attn_matrices":
            return (f"refactor_factored_attn_matrices is not defined for {cfg.family}'s Mamba-2 blocks: they have no "
                    "attention heads (no W_Q, W_K); pass refactor_factored_attn_matrices=False", False)
        if option == "fold_ln":
            return f"fold_ln is not implemented for {cfg.family}'s Mamba-2 blocks; pass fold_ln=False", False
        if option == "fold_value_biases":
            return (f"fold_value_biases is not defined for {cfg.family}'s Mamba-2 blocks: they have no values; "
                    "pass fold_value_biases=False", False)
        return None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mamba
        self.n_heads, self.d_head, self.d_state, self.n_groups = m.n_heads, m.d_head, m.d_state, m.n_groups
        self.chunk_size, self.dt_range = m.chunk_size, (m.dt_min, m.dt_max)
        # The prompt form; the reference, recurrent_scan, computes the same (a test sets it per instance).
        self.scan = functools.partial(chunked_scan, chunk=m.chunk_size)
        d_inner, bc = m.n_heads * m.d_head, m.n_groups * m.d_state
        self.sizes = (d_inner, d_inner + 2 * bc, m.n_heads)  # z | x B C | dt
        self.in_proj = Linear(cfg.d_model, sum(self.sizes), bias=m.in_bias)
        self.conv_weight = nn.Parameter(torch.zeros(d_inner + 2 * bc, 1, m.conv_width))  # [channel, 1, width]
        self.conv_bias = nn.Parameter(torch.zeros(d_inner + 2 * bc)) if m.conv_bias else None  # [channel]
        self.dt_bias = nn.Parameter(torch.ones(m.n_heads))  # [head]
        self.A_log = nn.Parameter(torch.zeros(m.n_heads))  # [head]: the decay rate is exp(A_log)
        self.D = nn.Parameter(torch.ones(m.n_heads))  # [head]
        self.norm = GATED_NORMS[m.norm](d_inner, m.n_groups, cfg.norm_eps)
        # Granite 4's residual multiplier scales the write inside out_proj, as it does attention's (linear.ScaledLinear)
        self.out_proj = write_projection(d_inner, cfg.d_model, m.out_bias, cfg.scales.residual)
        self.hook_in_proj = HookPoint()  # [batch, pos, 2 d_inner + 2 n_groups d_state + head]
        self.hook_conv = HookPoint()  # [batch, pos, d_inner + 2 n_groups d_state]
        self.hook_B = HookPoint()  # [batch, pos, group, d_state]
        self.hook_C = HookPoint()  # [batch, pos, group, d_state]
        self.hook_dt = HookPoint()  # [batch, pos, head], float32
        self.hook_ssm_out = HookPoint()  # [batch, pos, head, d_head], float32
        self.hook_gate = HookPoint()  # [batch, pos, head, d_head]
        self.hook_state = HookPoint()  # [batch, head, d_head, d_state], float32, handed to its hook only when hooked
        # Falcon-H1's multipliers, chosen once: the plain projection wherever they are all 1
        scaled = m.in_multiplier != 1 or any(f != 1 for f in m.multipliers)
        self.in_multiplier, self.multipliers = m.in_multiplier, m.multipliers
        self._project = self._scaled_projection if scaled else self._projection
        self.out_multiplier = m.out_multiplier

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        """The block's write [batch, pos, d_model] from its normed stream x, with the forward's `state`
        (lenskit.pieces.forward_state: its KV cache entry, a `lenskit.kv_cache.MambaState`; None for a block alone,
        which has no cache)."""
        batch, pos, _ = x.shape
        past = None if state is None else state.entry(self)  # lenskit.kv_cache: None unless given past_kv_cache
        z, xbc_in, dt = self.hook_in_proj(self._project(x)).split(self.sizes, dim=-1)
        xbc = self.hook_conv(causal_conv(xbc_in, self.conv_weight, None if past is None else past.conv, self.conv_bias))
        xs, B, C = xbc.split([self.sizes[0], self.n_groups * self.d_state, self.n_groups * self.d_state], dim=-1)
        xs = xs.view(batch, pos, self.n_heads, self.d_head)
        B = self.hook_B(B.view(batch, pos, self.n_groups, self.d_state))
        C = self.hook_C(C.view(batch, pos, self.n_groups, self.d_state))
        dt = self.hook_dt(F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_range))  # [batch, pos, head]
        A = -self.A_log.float().exp()  # [head]
        start = None if past is None else past.state  # [batch, head, d_head, d_state]; None: a fresh state
        # one new position steps by the recurrence (a chunk would pad it to chunk_size); more go a chunk at a time
        scan = recurrent_scan if pos == 1 and start is not None else self.scan
        y, recurrent = scan(xs, dt, A, B, C, state=start)
        if past is not None:
            past.update(xbc_in, self.conv_weight.shape[-1], recurrent)
        if self.hook_state.has_hooks():
            self.hook_state(recurrent)
        y = self.hook_ssm_out(y + xs.float() * self.D.float()[:, None])  # [batch, pos, head, d_head]
        z = self.hook_gate(z.view(batch, pos, self.n_heads, self.d_head))
        out = self.out_proj(self.norm(y.flatten(2), z.flatten(2)).to(x.dtype))
        return out if self.out_multiplier == 1 else out * self.out_multiplier

    def _projection(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_proj(x)

    def _scaled_projection(self, x: torch.Tensor) -> torch.Tensor:
        """in_proj of x times in_multiplier, its z, x, B, C and dt parts each times their multiplier (Falcon-H1)."""
        bc = self.n_groups * self.d_state
        parts = self.in_proj(x * self.in_multiplier).split([self.sizes[0], self.sizes[0], bc, bc, self.n_heads], dim=-1)
        return torch.cat([part * f for part, f in zip(parts, self.multipliers)], dim=-1)

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, d_head={self.d_head}, d_state={self.d_state}, groups={self.n_groups}, "
                f"conv_width={self.conv_weight.shape[-1]}, chunk_size={self.chunk_size}")

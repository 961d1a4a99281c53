"""Rotary position embedding: the frequencies (plain, or rescaled as Llama 3.1 or YaRN do) and the rotation.

The rotation pairs dimension i with i + rotary_dim/2 (the "rotate half" convention of GPT-NeoX and
Llama checkpoints); with `rope.adjacent_pairs` it pairs dims 2i and 2i + 1 instead (Llama 4's complex pairs, whose
rotated q and k keep that layout). With partial rotary (Pythia's `rotary_pct`), only the first `rotary_dim`
dimensions of each head rotate; the rest pass through. Gemma 4's "proportional" rotary instead pairs dims across the
whole head and gives the pairs past `rope_proportion` of them a zero speed, so they do not turn.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, local: bool = False, dim: int | None = None) -> torch.Tensor:
    """[rotary_dim / 2] angular speeds in fp32, computed as transformers computes them. `local`: for a
    sliding-window block of a model whose local blocks have their own, unscaled base (Gemma 3). `dim`: the rotated
    width where a block's heads are not d_head wide (Gemma 4's full blocks); None: rotary_dim."""
    dim = cfg.rope.dim if dim is None else dim
    own_base = local and cfg.rope.local_base is not None
    base = cfg.rope.local_base if own_base else cfg.rope.base
    powers = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # [rotary_dim / 2]
    inv_freq = 1.0 / powers
    if own_base:
        return inv_freq
    if cfg.rope.type == "llama3":
        inv_freq = _llama3_rescale(inv_freq, cfg)
    elif cfg.rope.type == "linear":  # positions divided by the factor, i.e. every frequency is
        inv_freq = inv_freq / cfg.rope.factor
    elif cfg.rope.type == "yarn":
        inv_freq = _yarn_rescale(powers, cfg)
    elif cfg.rope.type == "proportional":  # the first share of pairs turn at their usual speed, the rest stand still
        turning = int(cfg.rope.proportion * dim // 2)
        inv_freq = torch.cat([inv_freq[:turning], inv_freq.new_zeros(dim // 2 - turning)]) / cfg.rope.factor
    return inv_freq


def attention_factor(cfg: ModelConfig, local: bool = False) -> float:
    """What cos and sin are multiplied by: YaRN's `rope_attention_factor`, by default 0.1 ln(factor) + 1 (the
    paper's sqrt(1/t)), so every score grows by its square; 1 for the other rotary types and for local blocks."""
    if cfg.rope.type != "yarn" or (local and cfg.rope.local_base is not None):
        return 1.0
    if cfg.rope.attention_factor is not None:
        return cfg.rope.attention_factor
    return 1.0 if cfg.rope.factor <= 1 else 0.1 * math.log(cfg.rope.factor) + 1.0


def _llama3_rescale(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's long-context scaling: slow (long-wavelength) frequencies are divided by `rope_factor`,
    fast ones kept, and the band between interpolated smoothly."""
    old_len = cfg.rope.original_n_ctx
    low_wavelen = old_len / cfg.rope.low_freq_factor
    high_wavelen = old_len / cfg.rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.rope.factor, inv_freq)
    smooth = (old_len / wavelen - cfg.rope.low_freq_factor) / (cfg.rope.high_freq_factor - cfg.rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_rescale(powers: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """YaRN's "NTK-by-parts": a pair of dims that turns more than `rope_beta_fast` times over the pre-training
    length keeps its speed, one that turns fewer than `rope_beta_slow` times is slowed by `rope_factor`, and the
    dims between are blended along a linear ramp over the dim index (whole dims at its ends with `rope_truncate`)."""
    dim, base, old_len = cfg.rope.dim, cfg.rope.base, cfg.rope.original_n_ctx

    def dim_turning(turns: float) -> float:  # the dim index whose pair turns `turns` times over old_len positions
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(cfg.rope.beta_fast), dim_turning(cfg.rope.beta_slow)
    if cfg.rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp, as transformers takes it
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [rotary_dim / 2]: 0 fast, 1 slow
    kept = 1 - ramp  # the share of each dim's own speed; written so the rounding is transformers'
    return 1.0 / (cfg.rope.factor * powers) * (1 - kept) + 1.0 / powers * kept


class Rotary(nn.Module):
    """Rotates the first `rotary_dim` dims of q and k by position-dependent angles.

    The cos/sin tables are plain attributes (not buffers), built on first use for the device and
    dtype at hand, and grown when a longer prompt arrives; they hold no learned state.
    """

    @classmethod
    def processing_refusal(cls, cfg: ModelConfig, option: str) -> tuple[str, bool] | None:
        """Why weight processing's `option` cannot be applied exactly where positions rotate (lenskit.processing)."""
        if option == "refactor_factored_attn_matrices":
            return (f"refactor_factored_attn_matrices is not defined for {cfg.family}: rotary positions make the QK "
                    "matrix depend on the positions (TransformerLens refuses it too); pass "
                    "refactor_factored_attn_matrices=False", False)
        return None

    def __init__(self, cfg: ModelConfig, local: bool = False, d_head: int | None = None) -> None:
        super().__init__()
        self.cfg, self.local = cfg, local
        # a block whose heads are wider than d_head (Gemma 4's full blocks) turns them whole (ModelConfig checks it)
        d_head = cfg.d_head if d_head is None else d_head
        self.rotary_dim = cfg.rope.dim if d_head == cfg.d_head else d_head
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self.attention_factor = attention_factor(cfg, local)
        # Chosen once: full rotary needs no split and re-join of the passed-through dims; which dims pair up.
        self._rotate = self._rotate_all if self.rotary_dim == d_head else self._rotate_part
        self._pairs = cfg.rope.adjacent_pairs
        self._partner = _adjacent_partner if self._pairs else _half_partner

    def tables(self, n_pos: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [pos, rotary_dim], for positions 0..n_pos-1."""
        tables = self._tables
        if tables is None or tables[0].shape[0] < n_pos or tables[0].device != like.device or tables[0].dtype != like.dtype:
            with torch.inference_mode(False), torch.no_grad():  # constants: also usable by a later forward autograd records
                tables = self._tables = self._build(n_pos, like)
        return tables[0][:n_pos], tables[1][:n_pos]

    def _build(self, n_pos: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables [n_pos, rotary_dim], as plain tensors: built under inference_mode they would be
        inference tensors, which no later forward that autograd records may save for backward."""
        inv_freq = inverse_frequencies(self.cfg, self.local, self.rotary_dim).to(like.device)
        angles = torch.outer(torch.arange(n_pos, device=like.device, dtype=torch.float32), inv_freq)  # [pos, rotary_dim/2]
        # [pos, rotary_dim]: each pair's angle on both of its dims
        angles = angles.repeat_interleave(2, dim=-1) if self._pairs else torch.cat([angles, angles], dim=-1)
        scale = self.attention_factor  # YaRN's, applied in fp32 before the cast as transformers applies it (1: exact)
        return (angles.cos() * scale).to(like.dtype), (angles.sin() * scale).to(like.dtype)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """x: [batch, pos, head, d_head] at positions start..start+pos-1 -> the same shape, rotated."""
        cos, sin = self.tables(start + x.shape[1], x)
        cos, sin = cos[start:], sin[start:]  # [pos, rotary_dim]
        return self._rotate(x, cos[:, None, :], sin[:, None, :])  # [pos, 1, rotary_dim], broadcast over heads

    def _rotate_all(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + self._partner(x) * sin

    def _rotate_part(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat([self._rotate_all(rot, cos, sin), rest], dim=-1)

    def extra_repr(self) -> str:
        pairs = ", adjacent pairs" if self._pairs else ""
        if self.local and self.cfg.rope.local_base is not None:
            return f"rotary_dim={self.rotary_dim}, base={self.cfg.rope.local_base}, rope_type='default' (local)"
        return f"rotary_dim={self.rotary_dim}, base={self.cfg.rope.base}, rope_type={self.cfg.rope.type!r}{pairs}"


def _half_partner(x: torch.Tensor) -> torch.Tensor:
    """Each dim's partner in the rotation, signed: (-x[half:], x[:half]) ("rotate half")."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _adjacent_partner(x: torch.Tensor) -> torch.Tensor:
    """Each dim's partner in the rotation, signed, where dims 2i and 2i + 1 pair up: (-x1, x0, -x3, x2, ...)."""
    return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)

"""Rotary position embedding: the frequencies (plain, or rescaled as Llama 3.1 does) and the rotation.

The rotation pairs dimension i with i + rotary_dim/2 (the "rotate half" convention of GPT-NeoX and
Llama checkpoints). With partial rotary (Pythia's `rotary_pct`), only the first `rotary_dim`
dimensions of each head rotate; the rest pass through.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """[rotary_dim / 2] angular speeds in fp32, computed as transformers computes them. `local`: for a
    sliding-window block of a model whose local blocks have their own, unscaled base (Gemma 3)."""
    dim = cfg.rotary_dim
    own_base = local and cfg.local_rotary_base is not None
    base = cfg.local_rotary_base if own_base else cfg.rotary_base
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if own_base:
        return inv_freq
    if cfg.rope_type == "llama3":
        inv_freq = _llama3_rescale(inv_freq, cfg)
    elif cfg.rope_type == "linear":  # positions divided by the factor, i.e. every frequency is
        inv_freq = inv_freq / cfg.rope_factor
    return inv_freq


def _llama3_rescale(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's long-context scaling: slow (long-wavelength) frequencies are divided by `rope_factor`,
    fast ones kept, and the band between interpolated smoothly."""
    old_len = cfg.rope_original_n_ctx
    low_wavelen = old_len / cfg.rope_low_freq_factor
    high_wavelen = old_len / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.rope_factor, inv_freq)
    smooth = (old_len / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """Rotates the first `rotary_dim` dims of q and k by position-dependent angles.

    The cos/sin tables are plain attributes (not buffers), built on first use for the device and
    dtype at hand, and grown when a longer prompt arrives; they hold no learned state.
    """

    def __init__(self, cfg: ModelConfig, local: bool = False) -> None:
        super().__init__()
        self.cfg, self.local = cfg, local
        self.rotary_dim = cfg.rotary_dim
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        # Chosen once: full rotary needs no split and re-join of the passed-through dims.
        self._rotate = self._rotate_all if cfg.rotary_dim == cfg.d_head else self._rotate_part

    def tables(self, n_pos: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [pos, rotary_dim], for positions 0..n_pos-1."""
        tables = self._tables
        if tables is None or tables[0].shape[0] < n_pos or tables[0].device != like.device or tables[0].dtype != like.dtype:
            inv_freq = inverse_frequencies(self.cfg, self.local).to(like.device)
            angles = torch.outer(torch.arange(n_pos, device=like.device, dtype=torch.float32), inv_freq)  # [pos, rotary_dim/2]
            angles = torch.cat([angles, angles], dim=-1)  # [pos, rotary_dim]
            tables = self._tables = (angles.cos().to(like.dtype), angles.sin().to(like.dtype))
        return tables[0][:n_pos], tables[1][:n_pos]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, pos, head, d_head] -> the same shape, rotated."""
        cos, sin = self.tables(x.shape[1], x)
        return self._rotate(x, cos[:, None, :], sin[:, None, :])  # [pos, 1, rotary_dim], broadcast over heads

    @staticmethod
    def _rotate_all(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin

    def _rotate_part(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat([self._rotate_all(rot, cos, sin), rest], dim=-1)

    def extra_repr(self) -> str:
        if self.local and self.cfg.local_rotary_base is not None:
            return f"rotary_dim={self.rotary_dim}, base={self.cfg.local_rotary_base}, rope_type='default' (local)"
        return f"rotary_dim={self.rotary_dim}, base={self.cfg.rotary_base}, rope_type={self.cfg.rope_type!r}"

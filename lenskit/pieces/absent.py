"""The half of a one-sublayer block that is not there (Nemotron-H, `cfg.block.one_sublayer`): `NoMixer`, the token
mixer of an MLP-only block, and `NoMLP`, the MLP of a mixer-only block. Each holds no weights and writes nothing:
the block's `hook_attn_out` or `hook_mlp_out` is zeros there (lenskit.pieces.layers.OneSublayerBlock), so every
block keeps the stream identities. They say what they are (`LAYER_TYPE`) where code asks a block for heads, weights
or hooks the missing half would have had."""

from __future__ import annotations

from torch import nn

from ..config import ModelConfig


class NoMixer(nn.Module):
    """An MLP-only block's token mixer (layer type "mlp"): no weights, no hooks, no cache entry read."""

    LAYER_TYPE = "MLP-only (no token mixer)"
    NO_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_z", "hook_attn_scores", "hook_pattern", "hook_rot_q", "hook_rot_k",
                "hook_result")

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        return {}

    @classmethod
    def core_flops(cls, cfg: ModelConfig, layer: int, n_keys: float) -> dict[str, float]:
        return {}

    @classmethod
    def processing_refusal(cls, cfg: ModelConfig, option: str) -> tuple[str, bool] | None:
        return None

    def __init__(self, *built_with: object) -> None:  # make_attention's arguments: nothing to build
        super().__init__()

    def norm_readers(self) -> list[nn.Linear]:
        return []


class NoMLP(nn.Module):
    """A mixer-only block's MLP (any layer type but "mlp" under one_sublayer): no weights, no hooks."""

    LAYER_TYPE = "mixer-only (no MLP)"

    @classmethod
    def params(cls, cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
        return {"mlp": (0, 0)}

    @classmethod
    def active_weights(cls, cfg: ModelConfig, layer: int = 0) -> int:
        return 0

    def norm_readers(self) -> list[nn.Linear]:
        return []

    def __init__(self, *built_with: object) -> None:  # make_mlp's arguments: nothing to build
        super().__init__()

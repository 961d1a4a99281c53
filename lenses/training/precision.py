"""Mixed precision for tuned-lens training (`Recipe.autocast`): bf16 torch.autocast around the frozen model's
forward and the step (the translators, and the readout's matmuls: `lenskit.pieces.linear.linear_into` follows
autocast), on a GPU only. The log-softmax, the KL and its gradient stay float32, in the step's float32 buffers."""

from __future__ import annotations

import contextlib

import torch

from .recipe import Recipe


def check_autocast(recipe: Recipe, device: torch.device) -> None:
    """Refuse `recipe.autocast` off a GPU, in one line: on the CPU, bf16 matmuls are emulated on most processors
    (lenskit.pieces.linear), so mixed precision would be slower, not faster; load the model in bf16 instead."""
    if recipe.autocast and device.type != "cuda":
        raise ValueError(f"--autocast (Recipe.autocast) is bf16 mixed precision on a GPU, and this run is on {device}; "
                         "drop it, or pass --device cuda (on the CPU, --dtype bf16 loads the model in bf16 instead)")


def mixed_precision(recipe: Recipe, device: torch.device):
    """torch.autocast to bf16 on `device` when the recipe asks for it (a GPU: `check_autocast`), else nothing."""
    if not recipe.autocast:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)

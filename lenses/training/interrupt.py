"""A stop signal during training (Ctrl-C, SIGTERM, SIGHUP, SIGUSR1; see `lenses.stopping`): stop between optimiser
steps, never inside one, so that the checkpoint written on the way out holds the weights after a whole number of
steps and the same command resumes exactly."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..stopping import StopGuard, stopped_by


class Interrupted(KeyboardInterrupt):
    """A stop signal during `train`: the steps done are checkpointed (with `out`); rerunning the same call resumes."""

    def __init__(self, step: int, ckpt: Path | None) -> None:
        self.step = step
        where = "run the same command to resume" if ckpt is not None else "nothing was saved (no --out)"
        super().__init__(f"{stopped_by()}interrupted at step {step}; {where}")


@contextlib.contextmanager
def interrupts_between_steps(opt: torch.optim.Optimizer):
    """A StopGuard for the training loop: its handler takes every stop signal (main thread only) for the block,
    and `opt.step` clears `interruptible` before it touches a weight (the loop sets it again after each step)."""
    guard = StopGuard()

    def closing(optimizer, args, kwargs) -> None:
        guard.interruptible = False

    hook = opt.register_step_pre_hook(closing)
    guard.install()
    try:
        yield guard
    finally:
        guard.restore()
        hook.remove()

"""Ctrl-C during training: stop between optimiser steps, never inside one, so that the checkpoint written on
the way out holds the weights after a whole number of steps and the same command resumes exactly."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

import torch


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `train`: the steps done are checkpointed (with `out`); rerunning the same call resumes."""

    def __init__(self, step: int, ckpt: Path | None) -> None:
        self.step = step
        where = "run the same command to resume" if ckpt is not None else "nothing was saved (no --out)"
        super().__init__(f"interrupted at step {step}; {where}")


class StepGuard:
    """Ctrl-C (SIGINT) during training: `requested` is set; KeyboardInterrupt is raised at once only while
    `interruptible` (the forward and backward passes), never once the optimiser has started changing the
    weights, so the weights are always those after a whole number of steps."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.interruptible = False

    def handler(self, signum, frame) -> None:
        first = not self.requested.is_set()
        self.requested.set()
        if first and self.interruptible:
            raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_between_steps(opt: torch.optim.Optimizer):
    """A StepGuard for the training loop: its SIGINT handler is installed (main thread only) for the block, and
    `opt.step` clears `interruptible` before it touches a weight (the loop sets it again after each step)."""
    guard = StepGuard()

    def closing(optimizer, args, kwargs) -> None:
        guard.interruptible = False

    hook = opt.register_step_pre_hook(closing)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, guard.handler) if main else None
    try:
        yield guard
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
        hook.remove()

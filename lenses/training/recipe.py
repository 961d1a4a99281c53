"""How a tuned lens is trained: the `Recipe` of settings, each checked on construction, and the defaults it
resolves from the data and the model (tuned-lens' recipe where the data allows it)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

MAX_TOKENS_PER_STEP = 2**18  # tuned-lens' step size; smaller data gets smaller steps (see Recipe)
DEFAULT_STEPS = 250  # tuned-lens' step count, where the data allows it
MIN_TOKENS_PER_STEP = 2**13  # the smallest default step: on small data, fewer steps rather than tiny batches


@dataclass(frozen=True)
class Recipe:
    """How to train. `None` fields are resolved from the data and model by `resolve`.

    Neither steps nor tokens_per_step given: 250 steps of min(2**18, data tokens / 250) tokens, but at
    least 2**13 tokens a step; data too small for that gets fewer steps (data tokens / 2**13), not smaller
    batches. Only steps given: min(2**18, data tokens / steps) tokens a step. Only tokens_per_step given:
    min(250, data tokens / tokens_per_step) steps. Either way one pass over the data at most, never
    repeating a window.
    """

    steps: int | None = None
    tokens_per_step: int | None = None
    ctx: int | None = None  # window length; default the model's n_ctx
    optimizer: str = "sgd"  # "sgd" (Nesterov) or "adam"
    lr: float | None = None  # sgd: 1.0 * (1 - momentum); adam: 1e-3
    momentum: float = 0.9  # SGD momentum, or Adam's beta1
    weight_decay: float = 1e-3
    warmup_steps: int | None = None  # sgd: 0; adam: min(1000, steps // 5)
    clip_grad_norm: float = 1.0
    seed: int = 0
    micro_batch_tokens: int = 2048  # tokens per forward; bounds memory (d_vocab floats per token per layer)
    ckpt_every: int = 10
    ckpt_minutes: float = 5.0  # and at most this long between checkpoints (one process; time decides when, never what)
    autocast: bool = False  # bf16 mixed precision on a GPU (torch.autocast): the frozen forward, translators, readout matmuls

    def __post_init__(self) -> None:
        """Check every field at construction: one line naming the field (and its flag) and what it must be."""
        for name, least, optional in (("steps", 1, True), ("tokens_per_step", 1, True), ("ctx", 2, True),
                                      ("warmup_steps", 0, True), ("micro_batch_tokens", 1, False), ("ckpt_every", 1, False)):
            value = getattr(self, name)
            if optional and value is None:
                continue
            if not _is_int(value) or value < least:
                raise ValueError(f"{_field(name)} must be an integer >= {least}, got {value!r}")
        if not isinstance(self.autocast, bool):
            raise ValueError(f"{_field('autocast')} must be True or False, got {self.autocast!r}")
        if not _is_int(self.seed):
            raise ValueError(f"{_field('seed')} must be an integer, got {self.seed!r}")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"{_field('optimizer')} must be 'sgd' or 'adam', got {self.optimizer!r}")
        for name, low, high, closed_low in (("lr", 0.0, math.inf, False), ("momentum", 0.0, 1.0, True),
                                            ("weight_decay", 0.0, math.inf, True), ("clip_grad_norm", 0.0, math.inf, False),
                                            ("ckpt_minutes", 0.0, math.inf, False)):
            value = getattr(self, name)
            if name == "lr" and value is None:
                continue
            ok = _is_real(value) and math.isfinite(value) and (value >= low if closed_low else value > low) and value < high
            if not ok:
                want = {"lr": "a finite number > 0", "momentum": "a number in [0, 1)", "weight_decay": "a finite number >= 0",
                        "clip_grad_norm": "a finite number > 0", "ckpt_minutes": "a finite number > 0"}[name]
                raise ValueError(f"{_field(name)} must be {want}, got {value!r}")

    def resolve(self, n_tokens: int, n_ctx: int, world_size: int = 1) -> "Recipe":
        """Fill in the defaults, and raise before any training if the data cannot supply the steps."""
        ctx = self.ctx or n_ctx
        if not 2 <= ctx <= n_ctx:
            raise ValueError(f"ctx={ctx} must be between 2 and the model's n_ctx={n_ctx}")
        n_windows = n_tokens // ctx
        steps = self.steps
        if self.tokens_per_step is None and steps is None:
            least = -(-MIN_TOKENS_PER_STEP // ctx)  # windows in the smallest default step
            per_step = min(MAX_TOKENS_PER_STEP // ctx, max(least, n_windows // DEFAULT_STEPS), n_windows)
            per_step -= per_step % world_size
            if per_step < world_size:
                raise ValueError(f"too few tokens: the data has {n_tokens:,}, less than one window of {ctx} tokens per "
                                 f"process ({world_size}); add data or lower --ctx")
            steps = min(DEFAULT_STEPS, n_windows // per_step)
            tokens_per_step = per_step * ctx
        elif self.tokens_per_step is None:
            per_step = min(MAX_TOKENS_PER_STEP // ctx, n_windows // steps)
            per_step -= per_step % world_size
            if per_step < world_size:
                raise ValueError(
                    f"too few tokens: {steps} steps need at least {steps * world_size} windows of {ctx} tokens "
                    f"({steps * world_size * ctx:,} tokens), but the data has {n_tokens:,}; add data or use fewer --steps"
                )
            tokens_per_step = per_step * ctx
        else:
            tokens_per_step = self.tokens_per_step
            if tokens_per_step % ctx or (tokens_per_step // ctx) % world_size:
                raise ValueError(f"tokens_per_step={tokens_per_step} must be a multiple of ctx x processes = {ctx} x {world_size}")
            if steps is None:
                steps = min(DEFAULT_STEPS, n_windows // (tokens_per_step // ctx))
                if steps < 1:
                    raise ValueError(f"too few tokens: one step of {tokens_per_step:,} tokens needs more than the data's "
                                     f"{n_windows:,} whole windows of {ctx}; add data or lower --tokens-per-step")
            need = steps * tokens_per_step
            if need > n_windows * ctx:
                raise ValueError(
                    f"too few tokens: {steps} steps x {tokens_per_step:,} tokens per step = {need:,} tokens, but the data "
                    f"has {n_windows:,} whole windows of {ctx} = {n_windows * ctx:,} tokens; add data, or lower --steps "
                    f"or --tokens-per-step"
                )
        lr = self.lr if self.lr is not None else (round(1.0 * (1 - self.momentum), 12) if self.optimizer == "sgd" else 1e-3)
        warmup = self.warmup_steps if self.warmup_steps is not None else (min(1000, steps // 5) if self.optimizer == "adam" else 0)
        return dataclasses.replace(self, steps=steps, ctx=ctx, tokens_per_step=tokens_per_step, lr=lr, warmup_steps=warmup)

    def continuing(self, saved: dict) -> "Recipe":
        """This recipe with the unset fields that depend on the step count taken from a saved run's resolved
        recipe, so that a rerun (or an extension to more steps) of that run reads the same windows."""
        fill = {k: saved.get(k) for k in ("steps", "tokens_per_step", "warmup_steps")
                if getattr(self, k) is None and _is_int(saved.get(k))}
        return dataclasses.replace(self, **fill)

    def lr_at(self, step: int) -> float:
        """Linear warmup (if any), then linear decay to zero at `steps`."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        return self.lr * max(0.0, (self.steps - step) / max(1, self.steps - self.warmup_steps))

    def identity(self) -> dict:
        """The fields that decide the result (a resumed run must match them)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("ckpt_every", "ckpt_minutes")}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _field(name: str) -> str:
    """A Recipe field, with the train-lens flag that sets it where there is one."""
    flag = name.replace("_", "-")
    return f"Recipe.{name} (--{flag})" if name in _FLAGS else f"Recipe.{name}"


_FLAGS = {"steps", "tokens_per_step", "seed", "ctx", "optimizer", "lr", "weight_decay", "micro_batch_tokens", "ckpt_every",
          "ckpt_minutes", "autocast"}

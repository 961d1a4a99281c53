"""The tuned-lens package's own training loop (tuned-lens 0.2.0, `tuned_lens.scripts.train_loop.Train`), one
step at a time on a model we load, for timing beside lenskit's trainer. Bench-only: `pip install -e .[bench]`.

Under torch 2.13 and transformers 5 the package needs three stand-ins, applied here and nowhere else:
- torchdata 0.10+ has no `dataloader2` or `datapipes`: empty modules satisfy the imports, and `Batches`
  replaces the DataLoader2 the loop iterates over (it yields the same windows every contender gets);
- its model loader passes `load_in_8bit=`, which transformers 5 rejects: we hand it the model and skip it;
- `_transformer_lens_available = False`, so it never reaches for TransformerLens' classes.
Everything else (the lens, the optimiser and schedule, the per-layer loss and backward under bf16 autocast,
clipping) is the package's code, run by its `Train.execute`.
"""

from __future__ import annotations

import contextlib
import io
import sys
import tempfile
import time
import types
from pathlib import Path

import torch


def import_package():
    """(ingredients, train_loop) modules of tuned-lens, with the stand-ins installed."""
    import torchdata

    for name in ("dataloader2", "datapipes"):
        full = f"torchdata.{name}"
        if full not in sys.modules:
            sys.modules[full] = types.ModuleType(full)
            setattr(torchdata, name, sys.modules[full])
    sys.modules["torchdata.dataloader2"].DataLoader2 = Batches
    from tuned_lens import model_surgery
    from tuned_lens.nn import lenses, unembed
    from tuned_lens.scripts import ingredients, train_loop

    for module in (model_surgery, unembed, lenses):
        module._transformer_lens_available = False
    return ingredients, train_loop


class Batches:
    """Stands in for torchdata's DataLoader2: yields {"input_ids": [batch, ctx]} and notes when the first left."""

    def __init__(self, windows: torch.Tensor, batch: int) -> None:
        self.windows, self.batch, self.started = windows, batch, None

    def seed(self, seed: int) -> None:
        pass  # the windows are already in the order every contender uses

    def __iter__(self):
        for i in range(0, len(self.windows), self.batch):
            if self.started is None:
                self.started = time.perf_counter()
            yield {"input_ids": self.windows[i: i + self.batch]}

    def state_dict(self) -> dict:
        return {}


class PackageTrainer:
    """`step(windows)`: one optimiser step of the package's loop on these windows [n, ctx]; returns seconds
    from the first batch handed out to the end of `opt.step()` (setup and saving are left out)."""

    def __init__(self, hf_model, micro_batch_tokens: int = 2048, autocast: bool = True) -> None:
        self.ingredients, self.train_loop = import_package()
        self.hf_model, self.micro_batch_tokens = hf_model, micro_batch_tokens
        self.autocast = autocast  # False: its loop with `torch.autocast` a no-op, so every matmul runs in fp32
        self.out = tempfile.TemporaryDirectory(prefix="tuned-lens-bench-")

    def step(self, windows: torch.Tensor) -> float:
        device = next(self.hf_model.parameters()).device

        def finished() -> float:  # on a GPU the step's work is queued: wait for it before reading the clock
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter()

        ing = self.ingredients
        n, ctx = windows.shape
        batch = max(1, self.micro_batch_tokens // ctx)
        loader = Batches(windows, batch)
        done: list[float] = []
        train = self.train_loop.Train(
            model=ing.Model(name="given"), data=ing.Data(), opt=ing.Optimizer(),
            dist=ing.Distributed(per_gpu_batch_size=batch), output=Path(self.out.name), num_steps=1, tokens_per_step=n * ctx,
        )
        train.model.load = lambda *args, **kwargs: (self.hf_model, "tokenizer not used")
        train.data.load = lambda tokenizer: ([{"input_ids": w} for w in windows], 1.0)
        train.dist.data_loader = lambda data: loader

        def create_optim(params):
            opt = ing.Optimizer.create_optim(train.opt, params)
            opt.register_step_post_hook(lambda *args: done.append(finished()))
            return opt

        train.opt.create_optim = create_optim
        saved = torch.autocast
        if not self.autocast:  # the loop looks `th.autocast` up on the torch module at each use
            torch.autocast = lambda *args, **kwargs: contextlib.nullcontext()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                train.execute()
        finally:
            torch.autocast = saved
        if loader.started is None or len(done) != 1:
            raise RuntimeError(f"the package's loop took {len(done)} optimiser steps, expected 1")
        return done[0] - loader.started

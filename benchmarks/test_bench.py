"""pytest-benchmark entry point for the same calls bench.py times (not collected by the default test run).

    python -m pytest benchmarks/test_bench.py --benchmark-group-by=param:shape

bench.py is the reference: it interleaves contenders and writes the report. This file is for
pytest-benchmark's own statistics, comparisons and saved runs (`--benchmark-autosave`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bench_cases import (
    contenders,
    ensure_model_folder,
    load_lenskit,
    load_transformer_lens,
    load_transformers,
    make_tokens,
)

pytest.importorskip("pytest_benchmark")

SHAPES = {"4x256": (4, 256), "1x1024": (1, 1024)}
CASES = ["transformers_forward", "lenskit_forward", "lenskit_cache", "tl_forward", "tl_cache"]


@pytest.fixture(scope="module")
def models():
    folder = ensure_model_folder(Path.home() / ".cache" / "lenskit" / "bench" / "gpt2-random-seed0", seed=0)
    return load_lenskit(folder), load_transformers(folder), load_transformer_lens(folder)[0]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_call(benchmark, models, shape, case):
    lk, hf, tl = models
    if case.startswith("tl") and tl is None:
        pytest.skip("transformer-lens is not installed or could not load the folder (pip install -e .[bench])")
    batch, pos = SHAPES[shape]
    fn = contenders(lk, hf, tl, make_tokens(batch, pos, lk.cfg.d_vocab, seed=0), lk.cfg.n_layers)[case]

    def call():
        with torch.inference_mode():
            return fn()

    out = benchmark.pedantic(call, rounds=5, iterations=1, warmup_rounds=1)
    logits = out if isinstance(out, torch.Tensor) else out[0]
    assert logits.shape == (batch, pos, lk.cfg.d_vocab)

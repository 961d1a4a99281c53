"""The same tuned-lens training under torchrun with DistributedDataParallel (gloo, 2 CPU processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import lenskit
from lens_fixtures import write_text_folder, write_tiny_model
from lenses import TunedLens
from lenses.training import Recipe, train
from lenskit.io.data import load_token_stream

# Two processes each sum half of every step's tokens and DDP averages the gradients, so the update is the
# same mean as in one process, up to float32 summation order. Over 20 SGD steps that stays below 1e-5.
TOLERANCE = 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("bias_only", [False, True], ids=["full", "bias_only"])
def test_torchrun_two_processes_match_one_process(tmp_path, bias_only):
    model_dir = write_tiny_model(tmp_path / "model")
    data = write_text_folder(tmp_path / "data", n=80)
    steps, ctx, per_step = 20, 16, 8 * 16
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "lenses.cli", "train-lens", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "ddp"),
           "--steps", str(steps), "--ctx", str(ctx), "--tokens-per-step", str(per_step), "--seed", "3", "--quiet",
           "--micro-batch-tokens", "32",  # 2 micro-batches per rank per step: DDP's no_sync path too
           *(["--bias-only"] if bias_only else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "processes: 2" in done.stdout
    config = json.loads((tmp_path / "ddp" / "config.json").read_text())
    assert config["run_identity"]["world_size"] == 2 and config["tokens_seen"] == steps * per_step
    assert config["bias_only"] is bias_only

    model = lenskit.HookedTransformer.from_pretrained(model_dir)
    stream = load_token_stream([data], model.tokenizer)
    single = train(TunedLens(model, bias_only=bias_only), stream, Recipe(steps=steps, ctx=ctx, tokens_per_step=per_step, seed=3,
                                                        micro_batch_tokens=32), progress=False)
    ddp = load_file(str(tmp_path / "ddp" / "lens.safetensors"))
    assert ddp.keys() == single.state_dict().keys()
    moved = 0.0
    for k, v in single.state_dict().items():
        assert (ddp[k] - v).abs().max().item() <= TOLERANCE, k
        moved = max(moved, v.abs().max().item())
    assert moved > 100 * TOLERANCE  # the lens did train, so the comparison means something
    # Per-step losses logged by rank 0 are the all-reduced means: the same numbers as one process saw.
    torch.testing.assert_close(torch.tensor(config["loss_history"]), torch.tensor(single.info["loss_history"]),
                               atol=2e-6, rtol=1e-4)  # both are rounded to 6 decimals

"""The same tuned-lens training under torchrun with DistributedDataParallel (gloo, 2 CPU processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from lens_fixtures import write_text_folder, write_tiny_model
from safetensors.torch import load_file

import lenskit
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


@pytest.mark.slow
def test_eval_lens_under_torchrun_matches_one_process(tmp_path):
    """Two ranks score disjoint windows; rank 0's tables equal one process's to 1e-6 (an odd number of windows,
    so the ranks' shares differ, and batches of 8 that the split changes)."""
    import pandas as pd
    from lens_fixtures import random_tuned

    from lenses.cli import main

    model_dir = write_tiny_model(tmp_path / "model")
    data = write_text_folder(tmp_path / "data", n=60)
    random_tuned(lenskit.HookedTransformer.from_pretrained(model_dir)).save(tmp_path / "lens")
    args = ["eval-lens", "--model", str(model_dir), "--lens", str(tmp_path / "lens"), "--data", str(data),
            "--ctx", "16", "--tokens", str(16 * 21), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "lenses.cli",
           *args, "--csv", str(tmp_path / "ddp.csv"), "--table", str(tmp_path / "ddp_tidy.csv")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("tokens in 21 windows") == 1  # rank 0 alone prints
    assert main([*args, "--csv", str(tmp_path / "one.csv"), "--table", str(tmp_path / "one_tidy.csv")]) == 0
    for ddp_file, one_file in (("ddp.csv", "one.csv"), ("ddp_tidy.csv", "one_tidy.csv")):
        ddp, one = pd.read_csv(tmp_path / ddp_file), pd.read_csv(tmp_path / one_file)
        assert list(ddp.columns) == list(one.columns) and len(ddp) == len(one) > 0
        numbers = one.select_dtypes("number").columns
        assert (ddp.drop(columns=numbers) == one.drop(columns=numbers)).all().all()
        assert (ddp[numbers] - one[numbers]).abs().max().max() <= 1e-6, ddp_file
    table = pd.read_csv(tmp_path / "one.csv")
    assert (table["kl_tuned"] - table["kl_logit"]).abs().max() > 1e-3  # the lenses differ: the columns mean something


def test_eval_ranks_score_disjoint_windows(monkeypatch):
    """Rank 1 of 2 scores windows 1, 3, 5, ... only (the gather is stubbed: each rank's own rows)."""
    import pandas as pd
    from conftest import make_hf_gpt2

    from lenses import LogitLens, evaluation

    model = lenskit.HookedTransformer.from_hf(make_hf_gpt2())
    windows = torch.randint(0, model.cfg.d_vocab, (7, 6), generator=torch.Generator().manual_seed(0))
    whole = evaluation.evaluate_windows(model, {"logit": LogitLens(model)}, windows, batch=2, progress=False)
    monkeypatch.setattr(evaluation, "_distributed", lambda: (1, 2))
    monkeypatch.setattr(evaluation, "_gathered", lambda rows, names, batch, world: rows)
    mine = evaluation.evaluate_windows(model, {"logit": LogitLens(model)}, windows, batch=2, progress=False)
    assert sorted(set(mine["window"])) == [1, 3, 5]
    want = whole[whole["window"].isin([1, 3, 5])].sort_values(["layer", "window"]).reset_index(drop=True)
    got = mine.sort_values(["layer", "window"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want, rtol=1e-6, atol=1e-7)

"""Tuned-lens training: the recipe, determinism, the loss going down, NaN handling, checkpoints, kill and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from lens_fixtures import write_text_folder, write_tiny_model
from safetensors import safe_open
from safetensors.torch import load_file

import lenskit
from lenses import LogitLens, TunedLens
from lenses.evaluation import evaluate
from lenses.training import CHECKPOINT_FILE, Recipe, train
from lenskit.io.data import load_token_stream

CTX = 16
SMALL = dict(steps=12, ctx=CTX, tokens_per_step=4 * CTX, ckpt_every=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = lenskit.HookedTransformer.from_pretrained(write_tiny_model(root / "model"))
    data = write_text_folder(root / "data", n=120)
    return model, load_token_stream([data], model.tokenizer), root


def weights(lens):
    return {k: v.clone() for k, v in lens.state_dict().items()}


def test_recipe_defaults_follow_tuned_lens_and_scale_to_the_data():
    r = Recipe(steps=100).resolve(n_tokens=10_000, n_ctx=16)
    assert r.optimizer == "sgd" and r.lr == pytest.approx(0.1) and r.momentum == 0.9 and r.weight_decay == 1e-3
    assert r.warmup_steps == 0 and r.clip_grad_norm == 1.0
    assert r.tokens_per_step == (10_000 // 16 // 100) * 16  # one pass over the data
    big = Recipe(steps=10).resolve(n_tokens=10**8, n_ctx=256)
    assert big.tokens_per_step == 2**18  # the paper's step where the data allows it
    assert [r.lr_at(s) for s in (0, 50, 99)] == pytest.approx([0.1, 0.05, 0.001])  # linear decay to zero
    adam = Recipe(steps=100, optimizer="adam").resolve(10_000, 16)
    assert adam.lr == 1e-3 and adam.warmup_steps == 20 and adam.lr_at(0) == pytest.approx(1e-3 / 20)


def test_too_few_tokens_is_refused_before_training(tiny, tmp_path):
    model, stream, _ = tiny
    lens = TunedLens(model)
    with pytest.raises(ValueError, match=r"too few tokens: 1000 steps x 64 tokens per step = 64,000 tokens, but the data has"):
        train(lens, stream, Recipe(steps=1000, ctx=CTX, tokens_per_step=64), out=tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="too few tokens"):
        train(lens, stream, Recipe(steps=10**6, ctx=CTX), progress=False)
    assert not (tmp_path / "out").exists()
    assert all(float(p.detach().abs().max()) == 0 for p in lens.parameters())


def test_training_lowers_kl_below_the_logit_lens_and_leaves_the_model_alone(tiny):
    model, stream, _ = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lens = train(TunedLens(model), stream, Recipe(steps=30, ctx=CTX, tokens_per_step=8 * CTX, lr=0.5), progress=False)
    history = lens.info["loss_history"]
    assert len(history) == 30 and len(history[0]) == model.cfg.n_layers
    assert all(late < early for early, late in zip(history[0], history[-1]))
    table = evaluate(model, [LogitLens(model), lens], stream, ctx=CTX, progress=False)
    assert (table["kl_tuned"][:-1] < table["kl_logit"][:-1]).all()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    assert lens.info["tokens_seen"] == 30 * 8 * CTX


def test_same_seed_same_weights_other_seed_other_weights(tiny):
    model, stream, _ = tiny
    runs = [weights(train(TunedLens(model), stream, Recipe(**SMALL, seed=s), progress=False)) for s in (0, 0, 1)]
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not all(torch.equal(runs[0][k], runs[2][k]) for k in runs[0])


def test_adam_and_resid_mid_translators_train(tiny):
    model, stream, _ = tiny
    lens = train(TunedLens(model, resid_mid=True), stream, Recipe(**{**SMALL, "steps": 20}, optimizer="adam", lr=1e-2),
                 progress=False)
    assert lens.info["stream_labels"] == ["0", "0.mid", "1", "1.mid", "2", "2.mid"]
    history = lens.info["loss_history"]
    assert all(late < early for early, late in zip(history[0], history[-1]))
    assert all(float(t.weight.detach().abs().max()) > 0 for t in lens.mid_translators)


def test_weight_decay_applies_to_A_and_b(tiny):
    from lenses.training import make_optimizer

    model, _, _ = tiny
    lens = TunedLens(model)
    opt = make_optimizer(list(lens.parameters()), Recipe().resolve(10_000, 16))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(p) for p in lens.parameters()}  # decay toward zero A, b = toward the identity map
    assert opt.defaults["nesterov"] and opt.defaults["momentum"] == 0.9


def test_finished_run_is_saved_and_a_rerun_does_nothing(tiny, tmp_path):
    model, stream, _ = tiny
    lens = train(TunedLens(model), stream, Recipe(**SMALL), out=tmp_path / "out", progress=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["README.md", "config.json", "lens.safetensors"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["steps_done"] == 12 and config["tokens_seen"] == 12 * 4 * CTX
    assert config["recipe"]["tokens_per_step"] == 4 * CTX and config["data"]["sha256"] == stream.provenance["sha256"]
    again = train(TunedLens(model), stream, Recipe(**SMALL), out=tmp_path / "out", progress=False)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), lens.state_dict().values()))
    with pytest.raises(ValueError, match="belongs to a different run") as refused:
        train(TunedLens(model), stream, Recipe(**{**SMALL, "seed": 3}), out=tmp_path / "out", progress=False)
    message = str(refused.value)
    assert "seed (saved 0, now 3) differ" in message and "\n" not in message and "{" not in message  # no whole dicts
    assert "lr" not in message and "tokens_per_step" not in message  # only the field that differs
    with pytest.raises(ValueError, match=r"12 steps done, more than --steps 5; pass --steps 12 or more"):
        train(TunedLens(model), stream, Recipe(**{**SMALL, "steps": 5}), out=tmp_path / "out", progress=False)


def test_extending_a_finished_run_continues_it_with_the_schedule_rederived(tiny, tmp_path, capsys):
    model, stream, _ = tiny
    short = train(TunedLens(model), stream, Recipe(**SMALL), out=tmp_path / "out", progress=False)
    longer = train(TunedLens(model), stream, Recipe(**{**SMALL, "steps": 16}), out=tmp_path / "out", progress=False)
    assert "extending the finished lens" in capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["steps_done"] == 16 and config["recipe"]["steps"] == 16 and len(config["loss_history"]) == 16
    assert config["loss_history"][:12] == short.info["loss_history"]  # the first 12 steps are kept, not redone
    assert not torch.equal(longer.translators[0].weight, short.translators[0].weight)
    # Documented: not the same as a fresh 16-step run (other learning rates for steps 0-11, momentum restarted).
    fresh = train(TunedLens(model), stream, Recipe(**{**SMALL, "steps": 16}), progress=False)
    assert not torch.equal(fresh.translators[0].weight, longer.translators[0].weight)
    # A rerun without --steps takes the saved run's 16 and has nothing to do.
    again = train(TunedLens(model), stream, Recipe(ctx=CTX, tokens_per_step=4 * CTX, ckpt_every=4), out=tmp_path / "out",
                  progress=False)
    assert "already trained (16 steps); nothing to do" in capsys.readouterr().out
    assert torch.equal(again.translators[0].weight, longer.translators[0].weight)


def interrupt_at_call(n: int):
    """A hook that raises KeyboardInterrupt (what Ctrl-C raises) on its n-th call: inside a step's forward."""
    calls = {"n": 0}

    def hook(x, hook):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
    return hook


def test_ctrl_c_saves_the_steps_done_and_the_same_call_resumes_exactly(tiny, tmp_path):
    from lenses.training.interrupt import Interrupted

    model, stream, _ = tiny
    with model.hooks([("blocks.1.hook_resid_pre", interrupt_at_call(7))]):  # one forward per step: during step 6
        with pytest.raises(Interrupted, match="interrupted at step 6; run the same command to resume"):
            train(TunedLens(model), stream, Recipe(**SMALL), out=tmp_path / "out", progress=False)
    with safe_open(str(tmp_path / "out" / CHECKPOINT_FILE), "pt") as f:
        assert json.loads(f.metadata()["meta"])["step"] == 6  # saved at once, not at the next ckpt_every
    resumed = train(TunedLens(model), stream, Recipe(**SMALL), out=tmp_path / "out", progress=False)
    clean = train(TunedLens(model), stream, Recipe(**SMALL), progress=False)
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in clean.state_dict().items())
    assert resumed.info["loss_history"] == clean.info["loss_history"]


def test_an_interrupted_run_can_be_extended_from_its_checkpoint(tiny, tmp_path, capsys):
    model, stream, _ = tiny
    with model.hooks([("blocks.1.hook_resid_pre", interrupt_at_call(5))]), pytest.raises(KeyboardInterrupt):
        train(TunedLens(model), stream, Recipe(**SMALL), out=tmp_path / "out", progress=False)
    lens = train(TunedLens(model), stream, Recipe(**{**SMALL, "steps": 20}), out=tmp_path / "out", progress=False)
    out = capsys.readouterr().out
    assert "resuming from step 4 of 20" in out and "re-derived for 20 steps" in out
    assert lens.info["steps_done"] == 20 and len(lens.info["loss_history"]) == 20


def test_default_steps_give_real_batches_and_fewer_steps_on_small_data():
    big = Recipe().resolve(n_tokens=10**8, n_ctx=256)
    assert (big.steps, big.tokens_per_step) == (250, 2**18)  # tuned-lens' recipe where the data allows it
    medium = Recipe().resolve(n_tokens=10**6, n_ctx=256)  # 3,906 windows: 250 steps would be 15 windows each
    assert medium.tokens_per_step == 2**13 and medium.steps == 3906 // 32
    small = Recipe().resolve(n_tokens=10_000, n_ctx=16)
    assert (small.steps, small.tokens_per_step) == (1, 2**13)
    tiny_data = Recipe().resolve(n_tokens=100, n_ctx=16)  # less than one default batch: one step of all of it
    assert (tiny_data.steps, tiny_data.tokens_per_step) == (1, 96)
    given = Recipe(tokens_per_step=64).resolve(n_tokens=10_000, n_ctx=16)
    assert given.steps == min(250, 625 // 4)


def test_nan_loss_stops_with_a_clear_error_and_keeps_the_last_checkpoint(tiny, tmp_path):
    model, stream, _ = tiny
    calls = {"n": 0}

    def poison(x, hook):  # every step runs the model once (4 windows <= one micro-batch); step 6 gets NaN
        calls["n"] += 1
        if calls["n"] == 7:
            x = x.clone()
            x[0, 3] = float("nan")  # one position of one window
            return x

    with model.hooks([("blocks.1.hook_resid_pre", poison)]):
        with pytest.raises(FloatingPointError, match=r"NaN or inf at step 6 .*last good checkpoint .* is intact"):
            train(TunedLens(model), stream, Recipe(**SMALL), out=tmp_path / "out", progress=False)
    ckpt = tmp_path / "out" / CHECKPOINT_FILE
    with safe_open(str(ckpt), "pt") as f:
        assert json.loads(f.metadata()["meta"])["step"] == 4
    saved = {k[5:]: v for k, v in load_file(str(ckpt)).items() if k.startswith("lens.")}
    clean = weights(train(TunedLens(model), stream, Recipe(**{**SMALL, "steps": 12}), progress=False))
    assert set(saved) == set(clean)
    assert all(torch.isfinite(v).all() for v in saved.values())
    assert not model.hook_dict["blocks.1.hook_resid_pre"].has_hooks()
    # The checkpoint resumes to the same result as a clean run.
    resumed = train(TunedLens(model), stream, Recipe(**SMALL), out=tmp_path / "out", progress=False)
    assert all(torch.equal(resumed.state_dict()[k], clean[k]) for k in clean)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
def test_loss_record_flags_any_non_finite_final_logit(bad):
    from lenses.training import loss_record

    final = torch.randn(2, 5, 11)
    if bad is not None:
        final[1, 3, 7] = bad
    logged = loss_record(torch.tensor([1.5, 2.5]), final, world=1)
    assert logged.dtype == torch.float64 and logged[:2].tolist() == [1.5, 2.5]
    assert logged[-1].item() == (0.0 if bad is None else 1.0)


def cli(*args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return [sys.executable, "-m", "lenses.cli", *args], env


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_same_weights_as_an_uninterrupted_run(tiny, tmp_path):
    """Kill a training process with SIGKILL right after a checkpoint lands, rerun the same command, and
    compare with a run that was never interrupted: every weight must be bit-identical on this CPU."""
    _, _, root = tiny
    args = ["train-lens", "--model", str(root / "model"), "--data", str(root / "data"), "--steps", "150",
            "--tokens-per-step", str(2 * CTX), "--ctx", str(CTX), "--seed", "5", "--quiet"]
    cmd, env = cli(*args, "--out", str(tmp_path / "straight"), "--ckpt-every", "150")
    subprocess.run(cmd, env=env, check=True, capture_output=True)

    cmd, env = cli(*args, "--out", str(tmp_path / "killed"), "--ckpt-every", "7")
    ckpt = tmp_path / "killed" / CHECKPOINT_FILE
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed; make it longer"
    with safe_open(str(ckpt), "pt") as f:
        step = json.loads(f.metadata()["meta"])["step"]
    assert 0 < step < 150
    assert not (tmp_path / "killed" / "config.json").exists()

    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    assert f"resuming from step {step}" in done.stdout + done.stderr
    a = load_file(str(tmp_path / "straight" / "lens.safetensors"))
    b = load_file(str(tmp_path / "killed" / "lens.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "killed" / "config.json").read_text())["steps_done"] == 150



@pytest.mark.slow
def test_sigint_saves_says_how_to_resume_and_the_same_command_resumes(tiny, tmp_path):
    """Ctrl-C (SIGINT) on the real console program: a checkpoint of the steps done, one line saying so, exit 130,
    no traceback; the same command then resumes from that step and finishes."""
    _, _, root = tiny
    cmd, env = cli("train-lens", "--model", str(root / "model"), "--data", str(root / "data"), "--steps", "150",
                   "--tokens-per-step", str(2 * CTX), "--ctx", str(CTX), "--ckpt-every", "5", "--quiet",
                   "--out", str(tmp_path / "out"))
    ckpt = tmp_path / "out" / CHECKPOINT_FILE
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "run the same command to resume" in lines[0], err
    step = int(lines[0].split("interrupted at step ")[1].split(";")[0])
    with safe_open(str(ckpt), "pt") as f:
        assert json.loads(f.metadata()["meta"])["step"] == step  # the steps done, not the last --ckpt-every
    assert 0 < step < 150 and "wrote" not in out
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    assert f"resuming from step {step} of 150" in done.stdout
    assert json.loads((tmp_path / "out" / "config.json").read_text())["steps_done"] == 150

def test_micro_batches_change_memory_not_the_result(tiny):
    model, stream, _ = tiny
    whole = weights(train(TunedLens(model), stream, Recipe(**SMALL), progress=False))
    split = weights(train(TunedLens(model), stream, Recipe(**SMALL, micro_batch_tokens=CTX), progress=False))  # 4 passes
    for k in whole:
        torch.testing.assert_close(split[k], whole[k], atol=1e-6, rtol=1e-5)


def test_the_loop_is_resume_or_start_then_steps(tiny, tmp_path):
    """`train` is `resume_or_start` then `train_step` per step: the pieces, driven by hand, give the same weights."""
    from lenses.training import make_optimizer, resume_or_start, stream_label, train_step
    from lenses.training.step import TranslatedStreams
    from lenskit.io.data import window_order

    model, stream, _ = tiny
    recipe = Recipe(**{**SMALL, "steps": 3}).resolve(len(stream), model.cfg.n_ctx)
    by_train = train(TunedLens(model, resid_mid=True), stream, recipe, progress=False)

    lens = TunedLens(model, resid_mid=True)
    opt = make_optimizer(list(lens.parameters()), recipe)
    assert resume_or_start(lens, opt, tmp_path / "fresh", {}, recipe, rank=0) == (0, [], None)
    assert (tmp_path / "fresh").is_dir() and not any((tmp_path / "fresh").iterdir())
    windows = stream.windows(recipe.ctx)
    order, per_step = window_order(len(windows), recipe.seed), recipe.tokens_per_step // recipe.ctx
    labels = [stream_label(s) for s in lens.trained_streams()]
    assert labels[:2] == ["0", "0.mid"]
    for step in range(recipe.steps):
        ids = order[step * per_step: (step + 1) * per_step]
        losses = train_step(TranslatedStreams(lens), lens, opt, windows[ids], recipe, step, labels, 1, None)
        assert len(losses) == len(labels) and losses == by_train.info["loss_history"][step]
    for (k, a), b in zip(lens.state_dict().items(), by_train.state_dict().values()):
        assert torch.equal(a, b), k


# ------------------------------------------------------------------ bias-only lenses
def test_bias_only_training_equals_a_full_lens_with_A_frozen_by_hand(tiny):
    """The same seed, data and recipe: a bias-only lens (no A at all) and a full lens whose A_l were set to
    requires_grad False by hand end with the same biases, and the hand-frozen A_l stay exactly zero."""
    model, stream, _ = tiny
    recipe = Recipe(**{**SMALL, "steps": 20}, lr=0.5)
    bias_only = train(TunedLens(model, resid_mid=True, bias_only=True), stream, recipe, progress=False)
    by_hand = TunedLens(model, resid_mid=True)
    for t in [*by_hand.translators, *by_hand.mid_translators]:
        t.weight.requires_grad_(False)
    train(by_hand, stream, recipe, progress=False)
    assert sorted(bias_only.state_dict()) == sorted(k for k in by_hand.state_dict() if k.endswith(".bias"))
    for t in [*by_hand.translators, *by_hand.mid_translators]:
        assert torch.equal(t.weight, torch.zeros_like(t.weight))  # exactly: no gradient, no decay, no momentum
    for k, v in bias_only.state_dict().items():
        assert v.abs().max() > 1e-3, k  # every bias trained, so the match means something
        torch.testing.assert_close(v, by_hand.state_dict()[k], rtol=1e-5, atol=1e-7, msg=k)
    history = torch.tensor(bias_only.info["loss_history"])
    torch.testing.assert_close(history, torch.tensor(by_hand.info["loss_history"]), rtol=1e-4, atol=2e-6)
    assert (history[-1] < history[0]).all()
    # And it is not a full lens: a full lens trained alike ends elsewhere.
    full = train(TunedLens(model, resid_mid=True), stream, recipe, progress=False)
    assert not torch.allclose(full.translators[0].bias, bias_only.translators[0].bias, atol=1e-4)


def test_bias_only_checkpoints_hold_no_matrix_and_resume_with_another_setting_is_refused(tiny, tmp_path):
    model, stream, _ = tiny
    with model.hooks([("blocks.1.hook_resid_pre", interrupt_at_call(5))]), pytest.raises(KeyboardInterrupt):
        train(TunedLens(model, bias_only=True), stream, Recipe(**SMALL), out=tmp_path / "b", progress=False)
    d = model.cfg.d_model
    saved = load_file(str(tmp_path / "b" / CHECKPOINT_FILE))
    assert saved and all(v.shape == (d,) for v in saved.values())  # biases and their momentum, nothing d x d
    assert any(k.startswith("opt.") for k in saved)
    with pytest.raises(ValueError, match=r"bias_only \(saved true, now false\) differ"):
        train(TunedLens(model), stream, Recipe(**SMALL), out=tmp_path / "b", progress=False)
    # The hand-frozen A_l get no optimiser state either.
    by_hand = TunedLens(model)
    for t in by_hand.translators:
        t.weight.requires_grad_(False)
    with model.hooks([("blocks.1.hook_resid_pre", interrupt_at_call(5))]), pytest.raises(KeyboardInterrupt):
        train(by_hand, stream, Recipe(**SMALL), out=tmp_path / "h", progress=False)
    opt_state = {k: v for k, v in load_file(str(tmp_path / "h" / CHECKPOINT_FILE)).items() if k.startswith("opt.")}
    assert opt_state and all(v.shape == (d,) for v in opt_state.values())
    # A finished bias-only run: a full rerun into it is refused, the same setting finds it done.
    train(TunedLens(model, bias_only=True), stream, Recipe(**SMALL), out=tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match=r"bias_only \(saved true, now false\) differ"):
        train(TunedLens(model), stream, Recipe(**SMALL), out=tmp_path / "b", progress=False)
    again = train(TunedLens(model, bias_only=True), stream, Recipe(**SMALL), out=tmp_path / "b", progress=False)
    assert again.bias_only and again.info["steps_done"] == SMALL["steps"]


def test_runs_saved_before_bias_only_existed_still_resume_as_full_lenses(tiny, tmp_path, capsys):
    model, stream, _ = tiny
    train(TunedLens(model), stream, Recipe(**SMALL), out=tmp_path / "out", progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    del config["bias_only"], config["run_identity"]["bias_only"]  # as lenskit wrote them before
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    done = train(TunedLens(model), stream, Recipe(**SMALL), out=tmp_path / "out", progress=False)
    assert "already trained" in capsys.readouterr().out and not done.bias_only
    with pytest.raises(ValueError, match=r"bias_only \(saved false, now true\) differ"):
        train(TunedLens(model, bias_only=True), stream, Recipe(**SMALL), out=tmp_path / "out", progress=False)

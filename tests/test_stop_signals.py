"""Runs that survive their scheduler (lenses.stopping): SIGTERM, SIGHUP and SIGUSR1, sent to a real process, stop
train-lens, `lenskit cache`, the Jacobian fit and eval-lens --card as Ctrl-C does (checkpoint, one line, exit 128 +
the signal's number, the folder's lock released); the same command resumes, says from where, and ends where an
uninterrupted run ends. Checkpoints also come by elapsed time, which never changes a number."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lens_fixtures import write_text_folder, write_tiny_model
from safetensors import safe_open
from safetensors.torch import load_file

import lenses.training as training_module
import lenskit
from lenses import TunedLens
from lenses.stopping import STOP_SIGNALS, SaveClock, StopGuard, stops_interrupt
from lenses.training import CHECKPOINT_FILE, Recipe, train
from lenses.training.lock import LOCK_FILE
from lenskit.io.data import load_token_stream

pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
ROOT = Path(__file__).resolve().parents[1]
CTX = 16
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return write_tiny_model(root / "model"), write_text_folder(root / "data", n=120), root


def lenskit_cmd(*args) -> list[str]:
    return [sys.executable, "-m", "lenses.cli", *map(str, args)]


def stop_when(cmd: list[str], ready, sig: int) -> tuple[int, str, str]:
    """Start `cmd`, send `sig` as soon as `ready()` (the run reported progress), and return (code, stdout, stderr)."""
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.time() + 180
        while not ready() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        assert proc.poll() is None, "the run finished before the signal; make it longer"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    return proc.returncode, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


TRAIN = ["--steps", 100, "--tokens-per-step", 2 * CTX, "--ctx", CTX, "--seed", 3, "--quiet"]


@pytest.fixture(scope="module")
def straight_lens(tiny):
    model, data, root = tiny
    subprocess.run(lenskit_cmd("train-lens", "--model", model, "--data", data, *TRAIN, "--out", root / "straight"),
                   env=ENV, check=True, capture_output=True)
    return load_file(str(root / "straight" / "lens.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1], ids=lambda s: s.name)
def test_train_lens_saves_on_a_scheduler_signal_and_resumes_from_that_step(tiny, straight_lens, tmp_path, sig):
    model, data, _ = tiny
    out = tmp_path / "out"
    cmd = lenskit_cmd("train-lens", "--model", model, "--data", data, *TRAIN, "--ckpt-every", 3, "--out", out)
    code, stdout, err = stop_when(cmd, (out / CHECKPOINT_FILE).exists, sig)
    assert code == 128 + sig, err
    line = one_line(err)
    assert line.startswith(f"lenskit train-lens: {sig.name}: interrupted at step ") and "run the same command to resume" in line
    step = int(line.split("interrupted at step ")[1].split(";")[0])
    with safe_open(str(out / CHECKPOINT_FILE), "pt") as f:
        assert json.loads(f.metadata()["meta"])["step"] == step and 3 <= step < 100  # the steps done, saved on the way out
    assert not (out / LOCK_FILE).exists() and "wrote" not in stdout  # the lock released, nothing claimed finished
    done = subprocess.run(cmd, env=ENV, check=True, capture_output=True, text=True)
    assert [ln for ln in done.stdout.splitlines() if ln.startswith("resuming")] == [
        f"resuming from step {step} of 100 ({out / CHECKPOINT_FILE})"]
    got = load_file(str(out / "lens.safetensors"))
    assert got.keys() == straight_lens.keys() and all(torch.equal(got[k], straight_lens[k]) for k in got)


@pytest.mark.slow
def test_lenskit_cache_keeps_whole_shards_on_sigusr1_and_resumes(tiny, tmp_path):
    model, data, _ = tiny
    args = ["--model", model, "--data", data, "--hooks", "resid_post.1,mlp_out.0", "--ctx", CTX,
            "--windows-per-shard", 1, "--quiet"]
    subprocess.run(lenskit_cmd("cache", *args, "--out", tmp_path / "straight"), env=ENV, check=True, capture_output=True)
    out = tmp_path / "acts"
    cmd = lenskit_cmd("cache", *args, "--out", out)
    code, _, err = stop_when(cmd, lambda: len(list(out.glob("shard-*"))) >= 2, signal.SIGUSR1)
    assert code == 128 + signal.SIGUSR1, err
    assert one_line(err).startswith("lenskit cache: SIGUSR1: interrupted; the shards written are kept in")
    manifest = json.loads((out / "manifest.json").read_text())
    n = len(manifest["shards"])
    assert not manifest["complete"] and 1 <= n < manifest["n_shards"] and not (out / LOCK_FILE).exists()
    done = subprocess.run(cmd, env=ENV, check=True, capture_output=True, text=True)
    assert f"resuming the export in {out}: {n} of {manifest['n_shards']} shards done and verified" in done.stdout
    assert "fail verification" not in done.stdout
    want = {p.name: p.read_bytes() for p in (tmp_path / "straight").glob("shard-*")}
    assert {p.name: p.read_bytes() for p in out.glob("shard-*")} == want


JACOBIAN = """
import sys, torch, lenskit
from lenses import JacobianLens
from lenses.stopping import exit_code
model = lenskit.HookedTransformer.from_pretrained(sys.argv[1])
tokens = torch.randint(0, model.cfg.d_vocab, (300, 12), generator=torch.Generator().manual_seed(0))
try:
    JacobianLens.fit(model, tokens, out=sys.argv[2], skip_first_positions=2, checkpoint_every=2, progress=False)
except KeyboardInterrupt:
    print("fit interrupted", file=sys.stderr)
    sys.exit(exit_code())
"""


@pytest.mark.slow
def test_the_jacobian_fit_checkpoints_on_sighup_and_resumes_to_the_same_lens(tiny, tmp_path):
    from lenses.jacobian_fit import CHECKPOINT_FILE as JACOBIAN_CHECKPOINT

    model, _, _ = tiny
    (tmp_path / "fit.py").write_text(JACOBIAN)
    run = lambda out: [sys.executable, str(tmp_path / "fit.py"), str(model), str(out)]  # noqa: E731
    subprocess.run(run(tmp_path / "straight"), env=ENV, check=True, capture_output=True)
    out = tmp_path / "fit"
    code, _, err = stop_when(run(out), (out / JACOBIAN_CHECKPOINT).exists, signal.SIGHUP)
    assert code == 128 + signal.SIGHUP and one_line(err) == "fit interrupted", err
    with safe_open(str(out / JACOBIAN_CHECKPOINT), "pt") as f:
        start = json.loads(f.metadata()["meta"])["next_index"]
    assert 2 <= start < 300 and not (out / LOCK_FILE).exists()
    done = subprocess.run(run(out), env=ENV, check=True, capture_output=True, text=True)
    assert f"resuming the Jacobian lens fit at prompt {start} of 300" in done.stdout
    want, got = load_file(str(tmp_path / "straight" / "lens.safetensors")), load_file(str(out / "lens.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.slow
def test_eval_lens_card_stops_on_sigterm_with_the_card_as_it_was(tiny, tmp_path):
    model, data, root = tiny
    lens = tmp_path / "lens"
    loaded = lenskit.HookedTransformer.from_pretrained(model)
    train(TunedLens(loaded), load_token_stream([data], loaded.tokenizer), Recipe(steps=2, ctx=CTX, tokens_per_step=2 * CTX),
          out=lens, progress=False)
    shutil.copytree(lens, tmp_path / "straight")
    before = {p.name: p.read_bytes() for p in lens.iterdir()}
    args = ["--model", model, "--data", data, "--ctx", CTX, "--tokens", 1024, "--card", "--quiet"]
    code, _, err = stop_when(lenskit_cmd("eval-lens", "--lens", lens, *args), (lens / LOCK_FILE).exists, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    assert one_line(err) == "lenskit eval-lens: SIGTERM: interrupted"
    assert {p.name: p.read_bytes() for p in lens.iterdir()} == before  # nothing half written; the lock is gone
    for folder in (lens, tmp_path / "straight"):
        subprocess.run(lenskit_cmd("eval-lens", "--lens", folder, *args), env=ENV, check=True, capture_output=True)
    assert (lens / "README.md").read_text() == (tmp_path / "straight" / "README.md").read_text().replace("straight", "lens")
    assert json.loads((lens / "config.json").read_text())["eval"] == json.loads((tmp_path / "straight" / "config.json")
                                                                               .read_text())["eval"]


def test_the_save_clock_is_due_after_its_minutes(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("lenses.stopping.time.monotonic", lambda: now[0])
    clock = SaveClock(5)
    now[0] += 299.0
    assert not clock.due()
    now[0] += 1.0
    assert clock.due()
    clock.saved()
    assert not clock.due()
    for bad in (0, -1, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ValueError, match="checkpoint_minutes .* must be a finite number > 0"):
            SaveClock(bad)
    with pytest.raises(ValueError, match=r"Recipe.ckpt_minutes \(--ckpt-minutes\) must be a finite number > 0"):
        Recipe(ckpt_minutes=0)


def test_time_decides_when_to_save_never_the_numbers(tiny, tmp_path, monkeypatch):
    model_dir, data, _ = tiny
    model = lenskit.HookedTransformer.from_pretrained(model_dir)
    stream = load_token_stream([data], model.tokenizer)
    saved, real = [], training_module.save_checkpoint
    monkeypatch.setattr(training_module, "save_checkpoint", lambda path, lens, opt, meta: saved.append(meta["step"])
                        or real(path, lens, opt, meta))
    recipe = dict(steps=6, ctx=CTX, tokens_per_step=2 * CTX, ckpt_every=100)
    often = train(TunedLens(model), stream, Recipe(**recipe, ckpt_minutes=1e-9), out=tmp_path / "often", progress=False)
    assert saved == [1, 2, 3, 4, 5, 6]  # every step: each was past the (tiny) time limit
    saved.clear()
    rarely = train(TunedLens(model), stream, Recipe(**recipe), out=tmp_path / "rarely", progress=False)
    assert saved == [6]  # the last step only
    assert all(torch.equal(v, rarely.state_dict()[k]) for k, v in often.state_dict().items())
    assert often.info["recipe"] == rarely.info["recipe"]  # not part of the run's identity: a rerun may change it


def test_handlers_are_restored_and_a_signal_ignored_on_entry_stays_ignored():
    """`nohup` ignores SIGHUP (and a shell SIGINT for a background job): those runs must go on."""
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stops_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
            guard = StopGuard().install()
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGUSR1)  # not interruptible: noted, not raised
            assert guard.requested.is_set()
            guard.restore()
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)  # the handler runs at the next bytecode boundary
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before


def test_bad_minutes_are_one_line_and_leave_no_handler_behind(tiny, tmp_path, capsys):
    from lenses import JacobianLens
    from lenses.cli import main

    model_dir, data, _ = tiny
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    model = lenskit.HookedTransformer.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"checkpoint_minutes \(the minutes between checkpoints\) must be a finite"):
        JacobianLens.fit(model, torch.zeros(2, 20, dtype=torch.long), out=tmp_path / "j", checkpoint_minutes=0,
                         progress=False)
    assert main(["train-lens", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "t"),
                 "--ckpt-minutes", "-1"]) == 2
    assert "Recipe.ckpt_minutes (--ckpt-minutes) must be a finite number > 0, got -1.0" in capsys.readouterr().err
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before
    assert not (tmp_path / "t").exists() and not (tmp_path / "j" / LOCK_FILE).exists()

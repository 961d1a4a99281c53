"""Kill `train-lens` with SIGKILL at a random step, maybe cut its checkpoint short, and run it again.

The end state must be the lens an uninterrupted run writes, bit for bit, or a one-line refusal that names
the corrupt checkpoint and keeps it: never a traceback, and never a silent restart from step 0.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lens_fixtures import write_text_folder, write_tiny_model
from safetensors.torch import load_file

from lenses.training import CHECKPOINT_FILE
from lenses.training.lock import LOCK_FILE, FolderLockedError, folder_lock

ROOT = Path(__file__).resolve().parents[1]
STEPS = 100

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.name == "nt", reason="SIGKILL is POSIX")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    write_tiny_model(root / "model")
    write_text_folder(root / "train", n=150, seed=0)
    reference = root / "reference"
    proc = train(root, reference)
    assert proc.returncode == 0, proc.stderr
    return root, load_file(reference / "lens.safetensors")


def command(root: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "lenses.cli", "train-lens", "--model", str(root / "model"), "--data", str(root / "train"),
            "--out", str(out), "--steps", str(STEPS), "--tokens-per-step", "64", "--ctx", "16", "--ckpt-every", "1", "--quiet"]


def environment() -> dict[str, str]:
    # One thread everywhere: the exactness of resuming holds for the same thread count.
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def train(root: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command(root, out), capture_output=True, text=True, timeout=600, env=environment())


def hold_lock(out: Path) -> subprocess.Popen:
    """A live process that holds `out`'s lock until it is killed; returns once it holds it."""
    code = (f"import time\nfrom lenses.training.lock import folder_lock\nwith folder_lock({str(out)!r}):\n"
            "    print('locked', flush=True)\n    time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=environment())
    assert holder.stdout.readline() == "locked\n", "the lock holder did not start"
    return holder


def kill_at_random_step(root: Path, out: Path, rng: random.Random) -> None:
    """Start a run, wait for its first checkpoint, then SIGKILL it a random moment later."""
    proc = subprocess.Popen(command(root, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment())
    try:
        deadline = time.monotonic() + 300
        while not (out / CHECKPOINT_FILE).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.5))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)


def assert_same_lens(out: Path, want: dict) -> None:
    got = load_file(out / "lens.safetensors")
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].equal(want[k]), k


def assert_one_line_refusal(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("truncate", [False, True], ids=["killed", "killed-and-truncated"])
def test_killed_run_resumes_to_the_same_lens_or_refuses_clearly(setup, tmp_path, truncate):
    root, want = setup
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    out = tmp_path / "lens"
    kill_at_random_step(root, out, rng)
    ckpt = out / CHECKPOINT_FILE
    note = f"(random seed {seed})"
    if not ckpt.exists():  # the kill landed after the run finished: the lens must already be the reference one
        assert_same_lens(out, want)
        return
    if truncate:
        finished = (out / "lens.safetensors").exists()  # killed between saving the lens and removing the checkpoint
        size = ckpt.stat().st_size
        cut = rng.randrange(0, size)
        with open(ckpt, "r+b") as f:
            f.truncate(cut)
        proc = train(root, out)
        assert_one_line_refusal(proc, "corrupt", str(ckpt), "delete")
        assert ckpt.stat().st_size == cut, f"the corrupt checkpoint must be kept as it was {note}"
        assert finished or not (out / "lens.safetensors").exists()
        ckpt.unlink()  # what the message says to do
        proc = train(root, out)
        assert proc.returncode == 0, f"{note}\n{proc.stderr}"
    else:
        proc = train(root, out)
        assert proc.returncode == 0, f"{note}\n{proc.stderr}"
        assert "resuming from step" in proc.stdout, f"the rerun started from zero {note}:\n{proc.stdout}"
        resumed_at = int(proc.stdout.split("resuming from step")[1].split()[0])
        assert 1 <= resumed_at <= STEPS, note
    assert_same_lens(out, want)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "lens.safetensors"]


def test_a_second_run_into_the_same_folder_refuses(setup, tmp_path):
    root, _ = setup
    out = tmp_path / "lens"
    holder = hold_lock(out)
    try:
        proc = train(root, out)
        assert_one_line_refusal(proc, "in use by another lenskit run", f"pid {holder.pid}", "--out")
        assert (out / LOCK_FILE).read_text().split()[0] == str(holder.pid)  # the live owner keeps its lock
        assert not (out / CHECKPOINT_FILE).exists()
    finally:
        holder.kill()
        holder.communicate()


def test_a_lock_held_by_a_process_killed_with_sigkill_is_free_at_once(tmp_path):
    out = tmp_path / "lens"
    holder = hold_lock(out)
    try:
        with pytest.raises(FolderLockedError, match=f"in use by another lenskit run \\(pid {holder.pid} "):
            with folder_lock(out):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=60)
    assert holder.returncode == -signal.SIGKILL
    assert (out / LOCK_FILE).exists()  # the killed holder's file is left, unlocked: nothing to clear
    with folder_lock(out):
        assert (out / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    assert list(out.iterdir()) == []


def test_the_next_lock_holder_clears_the_staging_folders_of_a_run_killed_mid_write(tmp_path):
    out = tmp_path / "lens"
    staging = out / ".lens.safetensors.tmp12345"  # write_atomic's folder, with safetensors' own temporary file
    staging.mkdir(parents=True)
    (staging / ".tmpAb12Cd").write_bytes(b"half a lens")
    (out / ".notes.tmp").write_bytes(b"not write_atomic's")
    with folder_lock(out):
        pass
    assert sorted(p.name for p in out.iterdir()) == [".notes.tmp"]

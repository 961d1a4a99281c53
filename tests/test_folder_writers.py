"""One writer per lens folder (issue 29, item 8): `TunedLens.save`, `JacobianLens.save`, `train-lens`, the
Jacobian-lens fit and `eval-lens --card` take one folder lock; temporary names are unique per process and
thread; a killed writer's leftovers are cleared by the next; a stale lock raced by two processes has one winner."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from lens_fixtures import write_text_folder, write_tiny_model

import lenskit
from lenses import JacobianLens, TunedLens
from lenses.cli import main
from lenses.io import write_atomic
from lenses.training.lock import LOCK_FILE, FolderLockedError, folder_lock

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("writers")
    write_tiny_model(root / "model")
    write_text_folder(root / "heldout", n=6)
    return root, lenskit.HookedTransformer.from_pretrained(root / "model")


def lenses_of(model) -> dict[str, object]:
    d = model.cfg.d_model
    return {"tuned": TunedLens(model), "jacobian": JacobianLens(model, {0: torch.eye(d), 1: torch.eye(d)})}


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("kind", ["tuned", "jacobian"])
def test_threads_saving_one_folder_never_collide(tiny, tmp_path, kind):
    _, model = tiny
    lens = lenses_of(model)[kind]
    folder, errors = tmp_path / "lens", []
    start = threading.Barrier(8)

    def saves() -> None:
        start.wait()
        for _ in range(5):
            try:
                lens.save(folder)
            except Exception as e:  # noqa: BLE001 - every failure is collected and reported below
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=saves) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [], errors[:3]
    assert leftovers(folder) == []  # no staging folder, no lock file
    type(lens).load(folder, model)  # what the last writer left is a whole lens


def test_temporary_names_differ_per_thread(tmp_path):
    seen, start = [], threading.Barrier(4)

    def write(tmp: Path) -> None:
        seen.append(tmp.parent.name)
        start.wait(timeout=10)  # all four are inside write_atomic at once
        tmp.write_text("x")

    threads = [threading.Thread(target=write_atomic, args=(tmp_path / "f.json", write)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(set(seen)) == 4 and all(str(os.getpid()) in name for name in seen), seen
    assert (tmp_path / "f.json").read_text() == "x" and leftovers(tmp_path) == []


def hold_lock(folder: Path) -> subprocess.Popen:
    code = (f"import time\nfrom lenses.training.lock import folder_lock\nwith folder_lock({str(folder)!r}):\n"
            "    print('locked', flush=True)\n    time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
    assert holder.stdout.readline() == "locked\n"
    return holder


@pytest.mark.parametrize("kind", ["tuned", "jacobian"])
def test_save_into_a_folder_another_process_holds_is_refused(tiny, tmp_path, kind):
    _, model = tiny
    folder = tmp_path / "lens"
    holder = hold_lock(folder)
    try:
        with pytest.raises(FolderLockedError, match=f"in use by another lenskit run \\(pid {holder.pid}"):
            lenses_of(model)[kind].save(folder)
    finally:
        holder.kill()
        holder.wait()
    assert not (folder / "config.json").exists()


def test_a_training_run_saves_into_its_own_folder_but_a_second_holder_is_refused(tmp_path, tiny):
    _, model = tiny
    folder = tmp_path / "lens"
    with folder_lock(folder):
        TunedLens(model).save(folder)  # joins this thread's hold (what train does at its end)
        with pytest.raises(FolderLockedError, match=str(os.getpid())):
            with folder_lock(folder):
                pass
    assert (folder / "config.json").exists() and not (folder / LOCK_FILE).exists()


def card_argv(root: Path, lens: Path) -> list[str]:
    return ["eval-lens", "--lens", str(lens), "--model", str(root / "model"), "--data", str(root / "heldout"),
            "--tokens", "64", "--ctx", "16", "--quiet", "--card"]


def refuse_model_load(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the evaluation started before --card's folder was checked")
    monkeypatch.setattr(lenskit.HookedTransformer, "from_pretrained", refuse)


def test_card_takes_the_folder_lock(tiny, tmp_path, monkeypatch, capsys):
    root, model = tiny
    lens = TunedLens(model).save(tmp_path / "lens")
    holder = hold_lock(lens)
    try:
        refuse_model_load(monkeypatch)
        assert main(card_argv(root, lens)) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert "in use by another lenskit run" in err and str(holder.pid) in err and err.count("\n") == 1, err


@pytest.mark.parametrize("target", ["folder", "config.json", "README.md"])
def test_card_on_a_read_only_folder_fails_before_the_evaluation(tiny, tmp_path, monkeypatch, capsys, target):
    root, model = tiny
    lens = TunedLens(model).save(tmp_path / "lens")
    denied = lens if target == "folder" else lens / target
    real_access = os.access
    # os.access, not chmod: the test also holds when it runs as root, whom no mode stops.
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == denied else real_access(p, mode, **kw))
    refuse_model_load(monkeypatch)
    assert main(card_argv(root, lens)) == 2
    err = capsys.readouterr().err
    assert str(denied) in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_card_run_clears_what_a_killed_one_left(tiny, tmp_path, capsys):
    root, model = tiny
    lens = TunedLens(model).save(tmp_path / "lens")
    for name in (".config.json.tmp99999-1", ".README.md.tmp99999-2"):  # write_atomic's staging, from a killed --card
        (lens / name).mkdir()
        (lens / name / name.split(".tmp")[0].lstrip(".")).write_text("half")
    assert main(card_argv(root, lens)) == 0
    assert leftovers(lens) == []
    assert "## Evaluation" in (lens / "README.md").read_text() and "Not evaluated yet" not in (lens / "README.md").read_text()


RACER = """
import sys, time
from lenses.training.lock import FolderLockedError, folder_lock
start = float(sys.argv[2])
while time.time() < start:
    pass
try:
    with folder_lock(sys.argv[1]):
        print("won", flush=True)
        time.sleep(2)
except FolderLockedError:
    print("refused", flush=True)
"""


@pytest.mark.parametrize("stale", ["dead pid", "empty"])
def test_a_stale_lock_raced_by_two_processes_has_exactly_one_winner(tmp_path, stale):
    folder = tmp_path / "lens"
    folder.mkdir()
    (folder / LOCK_FILE).write_text("999999 gone-host\n" if stale == "dead pid" else "")  # its holder died
    start = time.time() + 3  # both started, imported and spinning by then
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(folder), str(start)], stdout=subprocess.PIPE,
                               text=True, env=ENV) for _ in range(2)]
    results = sorted(p.communicate(timeout=60)[0].strip() for p in racers)
    assert results == ["refused", "won"], results

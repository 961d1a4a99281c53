"""Training state on disk (issue 29, item 9): checkpoint and finished-lens fields checked on read, one line
naming the file and the field; a full disk is one line and keeps the last good checkpoint; Ctrl-C at any
moment, start-up included, is one line and exit 130."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from lens_fixtures import write_text_folder, write_tiny_model
from safetensors import safe_open
from safetensors.torch import save_file

import lenses.training as training
import lenses.tuned as tuned
import lenskit
from lenses import TunedLens
from lenses.cli import main
from lenses.training import CHECKPOINT_FILE, Recipe, train
from lenskit.io.data import load_token_stream

ROOT = Path(__file__).resolve().parents[1]
RECIPE = dict(ctx=16, tokens_per_step=32, ckpt_every=1)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("state")
    write_tiny_model(root / "model")
    write_text_folder(root / "train", n=30)
    model = lenskit.HookedTransformer.from_pretrained(root / "model")
    stream = load_token_stream([root / "train"], model.tokenizer)
    done = root / "done"  # a finished 2-step run: its identity is what a resumed run must match
    train(TunedLens(model), stream, Recipe(steps=2, **RECIPE), out=done, progress=False)
    return root, model, stream, json.loads((done / "config.json").read_text())


def write_checkpoint(path: Path, model, meta: dict) -> None:
    tensors = {f"lens.{k}": v.contiguous() for k, v in TunedLens(model).state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"meta": json.dumps(meta)})


def good_meta(config: dict) -> dict:
    return {"step": 1, "history": config["loss_history"][:1], "identity": config["run_identity"], "scalars": []}


@pytest.mark.parametrize("field,value", [("step", -3), ("step", "3"), ("step", 1.5), ("history", 5),
                                         ("history", [["x"]]), ("history", [[math.inf]]), ("scalars", "opt.0.step")])
def test_a_checkpoint_field_of_the_wrong_kind_is_one_line_naming_file_and_field(env, tmp_path, field, value):
    root, model, stream, config = env
    ckpt = tmp_path / "out" / CHECKPOINT_FILE
    write_checkpoint(ckpt, model, {**good_meta(config), field: value})
    with pytest.raises(ValueError) as e:
        train(TunedLens(model), stream, Recipe(steps=3, **RECIPE), out=tmp_path / "out", progress=False)
    message = str(e.value)
    assert str(ckpt) in message and repr(field) in message and "\n" not in message, message
    assert ckpt.exists()  # kept


@pytest.mark.parametrize("field", ["identity", "step", "history"])
def test_a_checkpoint_without_a_field_names_it(env, tmp_path, field):
    root, model, stream, config = env
    ckpt = tmp_path / "out" / CHECKPOINT_FILE
    meta = good_meta(config)
    del meta[field]
    write_checkpoint(ckpt, model, meta)
    with pytest.raises(ValueError, match=f"{CHECKPOINT_FILE}: the checkpoint metadata has no '{field}'"):
        train(TunedLens(model), stream, Recipe(steps=3, **RECIPE), out=tmp_path / "out", progress=False)


@pytest.mark.parametrize("field,value", [("steps_done", "2"), ("steps_done", -1), ("loss_history", 5),
                                         ("loss_history", [[None]]), ("run_identity", [])])
def test_a_finished_lens_field_of_the_wrong_kind_is_refused_before_extending(env, tmp_path, field, value):
    root, model, stream, config = env
    out = tmp_path / "out"
    TunedLens(model).save(out)
    (out / "config.json").write_text(json.dumps({**TunedLens(model).config(), **config, field: value}))
    with pytest.raises(ValueError) as e:
        train(TunedLens(model), stream, Recipe(steps=3, **RECIPE), out=out, progress=False)
    assert "config.json" in str(e.value) and repr(field) in str(e.value) and "\n" not in str(e.value), e.value


def test_a_finished_lens_without_run_identity_names_it(env, tmp_path):
    root, model, stream, config = env
    out = tmp_path / "out"
    TunedLens(model).save(out)
    (out / "config.json").write_text(json.dumps({**TunedLens(model).config(), "steps_done": 2, "loss_history": []}))
    with pytest.raises(ValueError, match="has no 'run_identity'"):
        train(TunedLens(model), stream, Recipe(steps=3, **RECIPE), out=out, progress=False)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_checkpoint_is_refused_not_waited_on(env, tmp_path):
    root, model, stream, _ = env
    (tmp_path / "out").mkdir()
    os.mkfifo(tmp_path / "out" / CHECKPOINT_FILE)
    with pytest.raises(OSError, match="FIFO"):
        train(TunedLens(model), stream, Recipe(steps=3, **RECIPE), out=tmp_path / "out", progress=False)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_lens_weights_file_says_what_it_is(env, tmp_path):
    _, model, _, _ = env
    folder = TunedLens(model).save(tmp_path / "lens")
    (folder / "lens.safetensors").unlink()
    os.mkfifo(folder / "lens.safetensors")
    with pytest.raises(OSError, match="not a regular file but a FIFO"):
        TunedLens.load(folder, model)


# ------------------------------------------------------------------ full disk
def filling_disk(real, after: int, kind: str):
    """A writer that works `after` times, then writes half a file and fails as a full disk does."""
    calls = {"n": 0}

    def write(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] <= after:
            return real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(b"\0" * 100)  # half-written
        if kind == "oserror":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on device\" })")
    return write


def checkpoint_step(path: Path) -> int:
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["meta"])["step"]


@pytest.mark.parametrize("kind", ["oserror", "safetensors"])
def test_a_full_disk_during_training_keeps_the_last_good_checkpoint(env, tmp_path, monkeypatch, kind):
    root, model, stream, _ = env
    out = tmp_path / "out"
    monkeypatch.setattr(training, "save_file", filling_disk(save_file, 2, kind))
    with pytest.raises(OSError) as e:
        train(TunedLens(model), stream, Recipe(steps=5, **RECIPE), out=out, progress=False)
    message = str(e.value)
    assert "disk is full" in message and "previous checkpoint.safetensors is kept" in message and "\n" not in message
    assert checkpoint_step(out / CHECKPOINT_FILE) == 2  # the last good one, whole
    assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT_FILE]  # no staging, no lock
    monkeypatch.undo()
    lens = train(TunedLens(model), stream, Recipe(steps=5, **RECIPE), out=out, progress=False)  # resumes
    assert lens.info["steps_done"] == 5


@pytest.mark.parametrize("kind", ["oserror", "safetensors"])
def test_a_full_disk_during_the_final_save_is_one_line_and_keeps_the_checkpoint(env, tmp_path, monkeypatch, capsys, kind):
    root, model, stream, _ = env
    out = tmp_path / "out"
    monkeypatch.setattr(tuned, "save_file", filling_disk(save_file, 0, kind))
    argv = ["train-lens", "--model", str(root / "model"), "--data", str(root / "train"), "--out", str(out),
            "--steps", "2", "--tokens-per-step", "32", "--ctx", "16", "--ckpt-every", "1", "--quiet"]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "lens.safetensors could not be written" in err[0] and "disk is full" in err[0], err
    assert checkpoint_step(out / CHECKPOINT_FILE) == 2 and not (out / "lens.safetensors").exists()


# ------------------------------------------------------------------ Ctrl-C
@pytest.mark.parametrize("argv", [["lens", "x"], ["eval-lens", "--lens", "logit", "--data", "."],
                                  ["ablate", "x", "--block", "0"]], ids=lambda a: a[0])
def test_ctrl_c_during_the_model_load_is_one_line_and_130(monkeypatch, capsys, argv):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(lenskit.HookedTransformer, "from_pretrained", interrupted)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err == f"lenskit {argv[0]}: interrupted\n", err


# A start-up hook: print a word and sleep at the moment named, so SIGINT lands exactly there.
HOOK = """
import os, sys, time
where = os.environ["LENSKIT_TEST_SLEEP_IN"]
if where == "import":
    class Sleeper:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                sys.meta_path.remove(self)
                print("sleeping", file=sys.stderr, flush=True)
                time.sleep(60)
            return None
    sys.meta_path.insert(0, Sleeper())
else:
    import lenskit
    def slow(*args, **kwargs):
        print("sleeping", file=sys.stderr, flush=True)
        time.sleep(60)
    lenskit.HookedTransformer.from_pretrained = slow
"""


@pytest.mark.skipif(os.name == "nt", reason="SIGINT to a child is POSIX")
@pytest.mark.parametrize("where", ["import", "model load"])
@pytest.mark.parametrize("command", [["lens", "x"], ["train-lens", "--data", ".", "--out", "OUT"]], ids=lambda c: c[0])
def test_sigint_at_start_up_is_one_line_and_130(tmp_path, where, command):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(HOOK)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'hook'}{os.pathsep}{ROOT}", "LENSKIT_TEST_SLEEP_IN": where,
           "OMP_NUM_THREADS": "1"}
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    proc = subprocess.Popen([sys.executable, "-m", "lenses.cli", *argv], stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path)
    try:
        assert proc.stderr.readline() == "sleeping\n"
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, rest
    assert rest == f"lenskit {command[0]}: interrupted\n", rest

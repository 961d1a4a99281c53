"""What tests/test_bad_input.py's table is made of: the `Row` record, the scratch `Env` every row runs in, and the
makers of bad input (truncated, locked, pickled, non-finite and misconfigured files, CLI runs on them)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from lens_fixtures import write_text_folder, write_tiny_model

import lenskit
from lenses.cli import main as cli_main
from lenses.training import CHECKPOINT_FILE, Recipe, train
from lenses.training.lock import folder_lock
from lenses.tuned import TunedLens
from lenskit.io.data import load_token_stream, read_documents

ROOT = Path(__file__).resolve().parents[1]
WORKS = "works"


@dataclass(frozen=True)
class Row:
    name: str
    run: Callable[["Env"], Any]  # an API call, or a CLI call that returns (exit code, stderr)
    expect: type[BaseException] | int | str  # exception type, CLI exit code, or WORKS
    words: tuple[str, ...] = ()
    check: Callable[["Env", Any], None] | None = None  # for WORKS rows: what the result must be


class Env:
    """The files the rows read, made once: a tiny model folder with a tokenizer, text data, a lens folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        write_tiny_model(root / "model")
        write_text_folder(root / "data", n=30, seed=0)
        self.model = lenskit.HookedTransformer.from_pretrained(root / "model")
        self.tokens = torch.randint(0, self.model.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(0))
        TunedLens(self.model).save(root / "lens")
        self.outcomes: dict[str, tuple[str, Any]] = {}

    def path(self, name: str) -> Path:
        """A fresh path under the root for one row."""
        p = self.root / "rows" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def stream(self):
        return load_token_stream([self.root / "data"], self.model.tokenizer)


def cli(*args: str) -> Callable[[Env], tuple[int, str]]:
    """An in-process CLI call; `{root}` in an argument is the Env root."""
    def run(env: Env) -> tuple[int, str]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli_main([a.format(root=env.root) for a in args])
        return code, err.getvalue()
    return run


def cli_subprocess(*args: str | bytes) -> Callable[[Env], tuple[int, str]]:
    """The real console program in a fresh interpreter (argv may hold raw bytes, as a shell can pass)."""
    def run(env: Env) -> tuple[int, str]:
        argv = [sys.executable, "-m", "lenses.cli", *(a.format(root=env.root) if isinstance(a, str) else a for a in args)]
        env_vars = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(argv, capture_output=True, timeout=300, env=env_vars)
        return proc.returncode, proc.stderr.decode("utf-8", "replace")
    run.slow = True  # a fresh interpreter imports torch: seconds per row
    return run


TRAIN = ("train-lens", "--model", "{root}/model", "--data", "{root}/data", "--ctx", "16", "--quiet")


# ----------------------------------------------------------------------------------------- helpers
def truncated_checkpoint(env: Env) -> Any:
    out = env.path("truncated_ckpt")
    out.mkdir()
    (out / CHECKPOINT_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"__metadata__\"")
    try:
        return train(TunedLens(env.model), env.stream(), Recipe(steps=2, ctx=16, tokens_per_step=32), out=out, progress=False)
    finally:
        assert (out / CHECKPOINT_FILE).exists(), "a corrupt checkpoint must be kept"


def locked_by_live_process(env: Env) -> Any:
    out = env.path("locked")
    with folder_lock(out):  # flock: a second open of the file is refused, also in this process
        return train(TunedLens(env.model), env.stream(), Recipe(steps=2, ctx=16, tokens_per_step=32), out=out,
                     progress=False)


def lock_twice(env: Env) -> Any:
    out = env.path("twice")
    with folder_lock(out), folder_lock(out):
        pass


def lock_released_on_interrupt(env: Env) -> Path:
    out = env.path("interrupt")
    with contextlib.suppress(KeyboardInterrupt), folder_lock(out):
        raise KeyboardInterrupt
    return out


def hook_to_half(env: Env) -> Any:
    def to_half(x, hook):
        return x.half()
    return env.model.run_with_hooks(env.tokens, fwd_hooks=[("blocks.0.hook_resid_post", to_half)])


def write_file(name: str, data: bytes) -> Callable[[Env], Path]:
    def make(env: Env) -> Path:
        p = env.path(name)
        p.write_bytes(data)
        return p
    return make


def read_data(name: str, data: bytes) -> Callable[[Env], Any]:
    return lambda env: read_documents([write_file(name, data)(env)])


def few_bad_bytes(env: Env) -> Any:
    path = write_file("few_bad.txt", b"x = 1\n" * 400 + b"\xff\xfe")(env)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        docs, _ = read_documents([path])
    return docs, [str(w.message) for w in caught]


def check_few_bad(env: Env, result: Any) -> None:
    docs, messages = result
    assert docs[0].text.count("\ufffd") == 2
    assert len(messages) == 1 and "2 bytes are not UTF-8" in messages[0], messages


def same_as_long(dtype: torch.dtype) -> Callable[[Env], Any]:
    small = torch.tensor([[0, 5, 99, 127], [1, 2, 3, 4]])  # ids every integer dtype holds
    return lambda env: (env.model(small.to(dtype)), env.model(small))


def check_equal(env: Env, result: Any) -> None:
    got, want = result
    assert torch.equal(got, want)


def truncated_model(env: Env) -> Any:
    folder = env.path("cut_model")
    shutil.copytree(env.root / "model", folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    return lenskit.HookedTransformer.from_pretrained(folder)


def locked_cli_run(env: Env) -> tuple[int, str]:
    out = env.path("cli_locked")
    with folder_lock(out):
        return cli(*TRAIN, "--out", str(out), "--steps", "2", "--tokens-per-step", "32")(env)


def read_only_out(env: Env) -> Any:
    parent = env.path("readonly")
    parent.mkdir()
    parent.chmod(0o555)
    try:
        return cli("train-lens", "--model", "{root}/model", "--data", "{root}/data", "--out", str(parent / "lens"),
                   "--steps", "2", "--ctx", "16", "--tokens-per-step", "32", "--quiet")(env)
    finally:
        parent.chmod(0o755)


# ----------------------------------------------------------------------------------------- lens and model folders
def lens_copy(name: str, env: "Env") -> Path:
    folder = env.path(name)
    shutil.copytree(env.root / "lens", folder)
    return folder


def lens_with_config(name: str, change: Callable[[dict], Any]) -> Callable[[Env], Path]:
    """A copy of the good lens folder whose config.json is `change(config)` (or config changed in place)."""
    def make(env: Env) -> Path:
        folder = lens_copy(name, env)
        config = json.loads((folder / "config.json").read_text())
        changed = change(config)
        (folder / "config.json").write_text(json.dumps(config if changed is None else changed))
        return folder
    return make


def lens_with_bytes(name: str, file: str, data: Callable[[bytes], bytes]) -> Callable[[Env], Path]:
    def make(env: Env) -> Path:
        folder = lens_copy(name, env)
        (folder / file).write_bytes(data((folder / file).read_bytes()))
        return folder
    return make


def load_lens(make: Callable[[Env], Path]) -> Callable[[Env], Any]:
    return lambda env: TunedLens.load(make(env), env.model)


def cli_on_lens(command: str, make: Callable[[Env], Path]) -> Callable[[Env], tuple[int, str]]:
    """`lenskit lens --lens FOLDER` or `lenskit eval-lens --lens FOLDER` on a folder `make` writes."""
    def run(env: Env) -> tuple[int, str]:
        folder = str(make(env))
        if command == "lens":
            return cli("lens", "x = 1", "--model", "{root}/model", "--lens", folder)(env)
        return cli("eval-lens", "--model", "{root}/model", "--lens", folder, "--data", "{root}/data", "--ctx", "16",
                   "--quiet")(env)
    return run


def set_key(key: str, value: Any) -> Callable[[dict], None]:
    return lambda config: config.__setitem__(key, value)


def drop_key(key: str) -> Callable[[dict], None]:
    def drop(config: dict) -> None:
        del config[key]
    return drop


def pickled_params(env: Env) -> Any:
    """A tuned-lens folder whose params.pt holds a pickled object: refused, never executed."""
    folder = env.path("pickled_params")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"d_model": 32, "num_hidden_layers": 3, "lens_type": "linear_tuned_lens"}))
    torch.save({"0.weight": Payload()}, folder / "params.pt")
    return TunedLens.load(folder, env.model)


class Payload:
    """Stands for an object whose unpickling would run code; weights_only refuses to build it."""


def nan_lens(env: Env) -> Any:
    from safetensors.torch import load_file, save_file

    folder = lens_copy("nan_lens", env)
    state = load_file(str(folder / "lens.safetensors"))
    state["translators.1.weight"][2, 3] = float("inf")
    save_file(state, str(folder / "lens.safetensors"))
    return TunedLens.load(folder, env.model)


def fp32_lens_on_bf16(env: Env) -> Any:
    bf16 = lenskit.HookedTransformer.from_pretrained(env.root / "model", dtype="bfloat16")
    lens = TunedLens.load(env.root / "lens", bf16)
    return lens(torch.zeros(1, 2, 32, dtype=torch.bfloat16), 1)


def check_bf16_readout(env: Env, logits: torch.Tensor) -> None:
    # The readout runs in the model's bf16; lenses hand back float32 logits for the metrics (issue 16).
    assert logits.dtype == torch.float32 and logits.shape == (1, 2, env.model.cfg.d_vocab)
    assert torch.isfinite(logits).all()


def saved_lens_modes(env: Env) -> dict[str, int]:
    old = os.umask(0o022)
    try:
        TunedLens(env.model).save(env.path("modes"))
    finally:
        os.umask(old)
    return {p.name: p.stat().st_mode & 0o777 for p in env.path("modes").iterdir()}


def model_with_config(name: str, **changes: Any) -> Callable[[Env], Any]:
    """from_pretrained on a copy of the tiny model whose config.json has `changes`."""
    def run(env: Env) -> Any:
        folder = env.path(name)
        shutil.copytree(env.root / "model", folder)
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))
        return lenskit.HookedTransformer.from_pretrained(folder)
    return run


def model_with_weight(name: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Env], Any]:
    """from_pretrained on a copy of the tiny model whose final-norm weight is `edit(weight)`."""
    def run(env: Env) -> Any:
        from safetensors.torch import load_file, save_file

        folder = env.path(name)
        shutil.copytree(env.root / "model", folder)
        state = load_file(str(folder / "model.safetensors"))
        key = next(k for k in state if k.endswith("ln_f.weight"))
        state[key] = edit(state[key].clone())
        save_file(state, str(folder / "model.safetensors"))
        return lenskit.HookedTransformer.from_pretrained(folder)
    return run


def with_nan(w: torch.Tensor) -> torch.Tensor:
    w[0] = float("nan")
    return w


def timed(run: Callable[[Env], Any], limit_s: float) -> Callable[[Env], Any]:
    """`run`, which must also fail within limit_s seconds."""
    def timed_run(env: Env) -> Any:
        start = time.perf_counter()
        try:
            return run(env)
        finally:
            assert time.perf_counter() - start < limit_s, f"took more than {limit_s} s"
    return timed_run



def rerun_finished(name: str, *changed: str) -> Callable[[Env], tuple[int, str]]:
    """train-lens into a folder, then again with `changed` flags: a different run must be refused by field."""
    def run(env: Env) -> tuple[int, str]:
        out = str(env.path(name))
        base = (*TRAIN, "--out", out, "--steps", "2", "--tokens-per-step", "32")
        code, err = cli(*base)(env)
        assert code == 0, err
        return cli(*base, *changed)(env)
    return run

"""`lenskit fit-jacobian`: the same J as JacobianLens.fit on the prompts the command documents; resumes; token files."""

from __future__ import annotations

import json

import pytest
import torch
from lens_fixtures import write_text_folder, write_tiny_model
from safetensors.torch import save_file

import lenses.jacobian_fit as jacobian_fit
import lenskit
from lenses import JacobianLens
from lenses.cli import main
from lenskit.io.data import load_token_stream

STREAMS = [0, 2]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fitj")
    write_tiny_model(root / "model")
    write_text_folder(root / "text", n=20, seed=0)
    return root


@pytest.fixture(scope="module")
def model(files):
    return lenskit.HookedTransformer.from_pretrained(files / "model")


def documented_prompts(model, folder, n: int, length: int, seed: int) -> torch.Tensor:
    """The module docstring's rule, written out: non-overlapping windows, n of them in a seeded order, kept in stream order."""
    tokens = load_token_stream([folder], model.tokenizer).tokens
    windows = tokens[: len(tokens) // length * length].view(-1, length)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))[:n]
    return windows[order.sort().values]


def args(files, out, *extra):
    return ["fit-jacobian", "--model", str(files / "model"), "--data", str(files / "text"), "--out", str(out),
            "--prompts", "5", "--tokens", "12", "--skip-first-positions", "2", "--streams", *map(str, STREAMS), "--quiet", *extra]


def assert_same_lens(a: JacobianLens, b: JacobianLens):
    assert a.streams == b.streams == STREAMS
    for s in STREAMS:
        torch.testing.assert_close(a.matrix(s), b.matrix(s), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def reference(files, model):
    prompts = documented_prompts(model, files / "text", n=5, length=12, seed=0)
    assert prompts.shape == (5, 12)
    return JacobianLens.fit(model, prompts, skip_first_positions=2, streams=STREAMS, progress=False)


def test_fit_jacobian_writes_the_lens_that_jacobianlens_fit_gives(files, model, reference, tmp_path, capsys):
    out = tmp_path / "jac"
    assert main(args(files, out)) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and f"--lens jacobian:{out}" in printed
    assert_same_lens(JacobianLens.load(out, model), reference)
    config = json.loads((out / "config.json").read_text())
    assert config["data"]["selection"] == {"prompts": 5, "tokens": 12, "seed": 0} and config["data"]["inputs"] == ["text"]
    assert config["estimator"]["n_prompts"] == 5

    assert main(args(files, out)) == 0  # a finished lens is left as it is
    printed = capsys.readouterr().out
    assert "nothing to do" in printed and "wrote" not in printed
    assert main(args(files, out, "--seed", "1")) == 2  # other prompts into the same folder: refused
    assert "error" in capsys.readouterr().err


def test_an_interrupted_fit_resumes_to_the_same_j(files, model, reference, tmp_path, monkeypatch, capsys):
    out = tmp_path / "jac"
    real, calls = jacobian_fit.prompt_jacobians, []

    def interrupted_at_the_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(jacobian_fit, "prompt_jacobians", interrupted_at_the_third)
    assert main(args(files, out)) == 130
    assert "run the same command to resume" in capsys.readouterr().err
    assert (out / jacobian_fit.CHECKPOINT_FILE).exists() and not (out / "config.json").exists()
    monkeypatch.setattr(jacobian_fit, "prompt_jacobians", real)
    assert main(args(files, out)) == 0
    assert "resuming the Jacobian lens fit at prompt 2 of 5" in capsys.readouterr().out
    assert_same_lens(JacobianLens.load(out, model), reference)


def test_token_files_are_prompts_as_they_are_or_a_stream(files, model, tmp_path):
    prompts = torch.randint(0, model.cfg.d_vocab, (4, 10), generator=torch.Generator().manual_seed(3))
    save_file({"tokens": prompts}, tmp_path / "prompts.safetensors")
    out = tmp_path / "from_prompts"
    assert main(["fit-jacobian", "--model", str(files / "model"), "--data", str(tmp_path / "prompts.safetensors"),
                 "--out", str(out), "--prompts", "3", "--skip-first-positions", "2", "--streams", "0", "2", "--quiet"]) == 0
    expected = JacobianLens.fit(model, prompts[:3], skip_first_positions=2, streams=STREAMS, progress=False)
    assert_same_lens(JacobianLens.load(out, model), expected)

    save_file({"tokens": prompts.flatten()}, tmp_path / "stream.safetensors")
    out = tmp_path / "from_stream"
    assert main(["fit-jacobian", "--model", str(files / "model"), "--data", str(tmp_path / "stream.safetensors"),
                 "--out", str(out), "--prompts", "2", "--tokens", "20", "--skip-first-positions", "2", "--streams", "0", "2",
                 "--quiet"]) == 0
    order = torch.randperm(2, generator=torch.Generator().manual_seed(0)).sort().values
    expected = JacobianLens.fit(model, prompts.flatten().view(2, 20)[order], skip_first_positions=2, streams=STREAMS, progress=False)
    assert_same_lens(JacobianLens.load(out, model), expected)


def test_bad_token_files_and_mixed_data_are_refused_in_one_line(files, tmp_path, capsys):
    save_file({"ids": torch.zeros(8, dtype=torch.long)}, tmp_path / "wrong_name.safetensors")
    save_file({"tokens": torch.zeros(8)}, tmp_path / "floats.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    for data, message in ((["wrong_name.safetensors"], "expected one tensor named 'tokens'"),
                          (["floats.safetensors"], "expected integer ids"),
                          (["junk.safetensors"], "is not a readable .safetensors file"),
                          (["floats.safetensors", str(files / "text")], "mixes token files (.safetensors) and text")):
        paths = [str(tmp_path / d) if d.endswith(".safetensors") else d for d in data]
        assert main(["fit-jacobian", "--model", str(files / "model"), "--data", *paths, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()

"""Device and dtype names (lenskit.devices) and the `--device` / `--dtype` options of every command that runs a
model: the spellings, "auto", one-line refusals before any work, and what the model was loaded as."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from lens_fixtures import write_text_folder, write_tiny_model

import lenskit
import lenskit.io.loading
from lenses.cli import main
from lenskit.devices import auto_dtype, checkpoint_dtype, parse_device, parse_dtype
from lenskit.pieces.linear import linear_into

CPU_ONLY_TORCH = torch.version.cuda is None and not torch.cuda.is_available()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("devices")
    write_tiny_model(root / "model", n_layer=2)
    write_text_folder(root / "text", n=40)
    return root


def commands(files, tmp_path) -> dict[str, list[str]]:
    """One cheap run of each command that runs a model."""
    model, text = str(files / "model"), str(files / "text")
    return {
        "lens": ["lens", "x = 1", "--model", model],
        "ablate": ["ablate", "x = alpha + 1", "--model", model, "--head", "0.1"],
        "train-lens": ["train-lens", "--model", model, "--data", text, "--out", str(tmp_path / "lens"), "--steps", "2",
                       "--tokens-per-step", "64", "--ctx", "16", "--quiet"],
        "eval-lens": ["eval-lens", "--model", model, "--lens", "logit", "--data", text, "--tokens", "64", "--ctx", "16",
                      "--quiet"],
        "cache": ["cache", "--model", model, "--data", text, "--hooks", "resid_post.0", "--out", str(tmp_path / "acts"),
                  "--tokens", "64", "--ctx", "16", "--quiet"],
    }


def bf16_checkpoint(files, tmp_path):
    """The tiny model saved in bf16, its config.json naming the dtype as transformers' save_pretrained does."""
    folder = tmp_path / "bf16-model"
    lenskit.HookedTransformer.from_pretrained(files / "model", dtype="bf16").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return folder


NAMES = ["lens", "ablate", "train-lens", "eval-lens", "cache"]


# ------------------------------------------------------------------ names
@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("fp32", torch.float32), ("bfloat16", torch.bfloat16),
                                         ("bf16", torch.bfloat16), ("float16", torch.float16), ("fp16", torch.float16),
                                         ("torch.bfloat16", torch.bfloat16), ("BF16", torch.bfloat16), (None, torch.float32),
                                         (torch.float64, torch.float64)])
def test_every_spelling_names_its_dtype(name, dtype):
    assert parse_dtype(name) is dtype


@pytest.mark.parametrize("name, hint", [("bf61", "did you mean 'bf16'?"), ("float23", "did you mean 'float32'?"),
                                        ("fp61", "did you mean 'fp16'?"), ("int8", "expected one of auto")])
def test_a_bad_spelling_is_one_line_with_the_nearest_name(name, hint):
    with pytest.raises(ValueError) as e:
        parse_dtype(name, name="--dtype")
    assert hint in str(e.value) and f"--dtype {name}" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="not a floating dtype"):
        parse_dtype(torch.int64)


def test_auto_is_resolved_by_the_caller_and_refused_without_a_checkpoint():
    assert parse_dtype("auto", auto=torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="needs a checkpoint"):
        parse_dtype("auto")
    assert checkpoint_dtype({"dtype": "bfloat16"}) is torch.bfloat16
    assert checkpoint_dtype({"torch_dtype": "float16"}) is torch.float16  # as transformers 4 wrote it
    assert checkpoint_dtype({"text_config": {"dtype": "bfloat16"}}) is torch.bfloat16
    assert checkpoint_dtype({"dtype": "float8_e4m3fn"}) is None and checkpoint_dtype({}) is None
    assert auto_dtype({"dtype": "bfloat16"}, accelerated=True) is torch.bfloat16
    assert auto_dtype({"dtype": "bfloat16"}, accelerated=False) is torch.float32  # the CPU: float32
    assert auto_dtype({}, accelerated=True) is torch.float32


def test_from_pretrained_takes_the_short_spellings_and_auto(files, tmp_path):
    folder = bf16_checkpoint(files, tmp_path)
    for name, want in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        assert lenskit.HookedTransformer.from_pretrained(folder, dtype=name).embed.weight.dtype is want
    assert lenskit.HookedTransformer.from_pretrained(folder, dtype="auto").embed.weight.dtype is torch.float32  # CPU
    # a device map places weights on accelerators: "auto" keeps the checkpoint's dtype there
    mapped = lenskit.HookedTransformer.from_pretrained(folder, dtype="auto", device_map={"": "cpu"})
    assert mapped.embed.weight.dtype is torch.bfloat16
    with pytest.raises(ValueError, match="did you mean 'bf16'"):
        lenskit.HookedTransformer.from_pretrained(folder, dtype="bf17")


@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="a torch built without CUDA")
def test_cuda_on_a_torch_without_it_is_one_line():
    with pytest.raises(ValueError, match="built without CUDA; pass --device cpu"):
        parse_device("cuda", name="--device")


def test_linear_into_follows_autocast():
    """Under autocast the readout's product runs in autocast's dtype, as F.linear does; an `out=` call would not."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 16, generator=g), torch.randn(40, 16, generator=g)
    out = torch.empty(5, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear_into(x, w, None, out)
        want = F.linear(x, w).float()
    assert want.dtype == torch.float32 and torch.equal(out, want)
    assert not torch.equal(out, x @ w.t())  # rounded through bf16
    assert torch.allclose(linear_into(x, w, None, torch.empty(5, 40)), x @ w.t())


# ------------------------------------------------------------------ the commands
@pytest.mark.parametrize("name", NAMES)
def test_each_command_runs_on_the_cpu_in_bf16_and_auto_is_float32(name, files, tmp_path, loads, capsys):
    argv = commands(files, tmp_path)[name]
    assert main([*argv, "--device", "cpu", "--dtype", "bf16"]) == 0, capsys.readouterr().err
    assert loads == [(torch.bfloat16, "cpu")]
    for sub in ("lens", "acts"):
        for path in (tmp_path / sub).glob("*"):
            path.unlink()
    assert main([*argv, "--dtype", "auto"]) == 0, capsys.readouterr().err
    assert loads[1] == (torch.float32, "cpu")


def test_fp16_on_the_cpu_and_the_same_numbers_as_the_python_api(files, tmp_path, loads):
    import pandas as pd

    from lenses import LogitLens, Trajectory

    csv = tmp_path / "lens.csv"
    assert main(["lens", "x = alpha + 1", "--model", str(files / "model"), "--dtype", "fp16", "--csv", str(csv)]) == 0
    assert loads == [(torch.float16, "cpu")]
    model = lenskit.HookedTransformer.from_pretrained(files / "model", dtype=torch.float16)
    want = Trajectory.from_prompt(LogitLens(model), "x = alpha + 1").to_frame()
    got = pd.read_csv(csv, keep_default_na=False)
    assert got["top_prob"].tolist() == pytest.approx(want["top_prob"].tolist(), abs=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_a_bad_dtype_or_an_absent_gpu_is_one_line_before_any_work(name, files, tmp_path, loads, capsys):
    argv = commands(files, tmp_path)[name]
    assert main([*argv, "--dtype", "bf61"]) == 2
    err = capsys.readouterr().err
    assert f"lenskit {name}: error: --dtype bf61" in err and "did you mean 'bf16'?" in err and err.count("\n") == 1, err
    if CPU_ONLY_TORCH:
        assert main([*argv, "--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert "--device cuda, but this torch" in err and "built without CUDA" in err and err.count("\n") == 1, err
    assert main([*argv, "--device", "tpu9"]) == 2
    assert "is not a device torch knows" in capsys.readouterr().err
    assert loads == [] and not (tmp_path / "lens").exists() and not (tmp_path / "acts").exists()


def test_the_default_device_is_cuda_where_torch_sees_one_and_says_so(monkeypatch, capsys):
    import argparse

    from lenses.cli.devices import model_options

    args = argparse.Namespace(device=None, dtype="auto", command="lens")
    assert model_options(args)["device"] == torch.device("cpu")
    if CPU_ONLY_TORCH:
        assert capsys.readouterr().err == ""  # no choice to report: this torch runs on the CPU alone
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build that sees no GPU: the CPU, said in one line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert model_options(args)["device"] == torch.device("cpu")
    assert capsys.readouterr().err == ("lenskit lens: device cpu (this torch ({}) sees no CUDA device; check nvidia-smi "
                                       "and CUDA_VISIBLE_DEVICES)\n").format(torch.__version__)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU seen: cuda by default, said in one line
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert model_options(args)["device"] == torch.device("cuda")
    assert capsys.readouterr().err == "lenskit lens: device cuda (torch sees 1 CUDA device(s); --device cpu for the CPU)\n"
    assert model_options(args, announce=False)["device"] == torch.device("cuda") and capsys.readouterr().err == ""
    # torchrun's device for this rank overrides the default, silently
    assert model_options(args, device=torch.device("cpu"))["device"] == torch.device("cpu") and capsys.readouterr().err == ""


def test_info_plans_in_the_checkpoints_dtype_and_takes_the_short_spellings(files, tmp_path, capsys):
    folder = bf16_checkpoint(files, tmp_path)
    plan = ["info", "--model", str(folder), "--device-map", "auto", "--max-memory", "cpu=1GiB"]
    assert main(plan) == 0 and "bfloat16 weights" in capsys.readouterr().out  # auto: the checkpoint's dtype
    assert main([*plan, "--dtype", "fp32"]) == 0 and "float32 weights" in capsys.readouterr().out
    assert main(["info", "--model", "llama-3.1-8b", "--device-map", "auto", "--max-memory", "cpu=100GiB"]) == 0
    assert "bfloat16 weights" in capsys.readouterr().out  # a preset names no dtype: bf16, as published
    assert main([*plan, "--dtype", "bf61"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'bf16'?" in err and err.count("\n") == 1


# ------------------------------------------------------------------ train-lens --autocast
def test_autocast_is_refused_off_a_gpu_in_one_line(files, tmp_path, loads, capsys):
    from lenses import TunedLens
    from lenses.training import Recipe, train
    from lenskit.io.data import load_token_stream

    argv = commands(files, tmp_path)["train-lens"]
    assert main([*argv, "--device", "cpu", "--autocast"]) == 2
    err = capsys.readouterr().err
    assert "--autocast (Recipe.autocast) is bf16 mixed precision on a GPU, and this run is on cpu" in err
    assert err.count("\n") == 1 and loads == [] and not (tmp_path / "lens").exists()
    model = lenskit.HookedTransformer.from_pretrained(files / "model")
    stream = load_token_stream([files / "text"], model.tokenizer)
    with pytest.raises(ValueError, match="mixed precision on a GPU"):
        train(TunedLens(model), stream, Recipe(steps=1, ctx=16, tokens_per_step=64, autocast=True), out=tmp_path / "api")
    assert not (tmp_path / "api").exists()
    with pytest.raises(ValueError, match=r"Recipe.autocast \(--autocast\) must be True or False"):
        Recipe(autocast="yes")


def test_autocast_is_in_the_card_and_the_run_identity(files, tmp_path, capsys):
    from lenses.training import check_same_run

    argv = commands(files, tmp_path)["train-lens"]
    assert main([*argv, "--device", "cpu"]) == 0
    config = json.loads((tmp_path / "lens" / "config.json").read_text())
    assert config["recipe"]["autocast"] is False and config["run_identity"]["recipe"]["autocast"] is False
    assert "| autocast | false |" in (tmp_path / "lens" / "README.md").read_text()
    saved = config["run_identity"]
    with_autocast = {**saved, "recipe": {**saved["recipe"], "autocast": True}}
    with pytest.raises(ValueError, match=r"autocast \(saved false, now true\) differ"):
        check_same_run(saved, with_autocast, tmp_path / "lens" / "config.json")
    # a run saved before the field existed ran without autocast, and resumes as such
    older = {**saved, "recipe": {k: v for k, v in saved["recipe"].items() if k != "autocast"}}
    check_same_run(older, saved, tmp_path / "lens" / "config.json")
    with pytest.raises(ValueError, match=r"autocast \(saved false, now true\)"):
        check_same_run(older, with_autocast, tmp_path / "lens" / "config.json")


def test_the_autocast_step_computes_the_same_objective(files, monkeypatch):
    """The mixed-precision path, run here under CPU autocast (the GPU refusal lifted): step 0 reads the untrained
    lens, so its KL is the logit lens's, the same in bf16 autocast as in fp32 up to bf16 rounding."""
    import lenses.training
    from lenses import TunedLens
    from lenses.training import Recipe, train
    from lenskit.io.data import load_token_stream

    monkeypatch.setattr(lenses.training, "check_autocast", lambda recipe, device: None)
    model = lenskit.HookedTransformer.from_pretrained(files / "model")
    stream = load_token_stream([files / "text"], model.tokenizer)
    runs = {flag: train(TunedLens(model), stream, Recipe(steps=2, ctx=16, tokens_per_step=64, autocast=flag), progress=False)
            for flag in (False, True)}
    full, mixed = (runs[flag].info["loss_history"][0] for flag in (False, True))
    assert mixed == pytest.approx(full, rel=0.05) and mixed != full
    assert all(p.dtype == torch.float32 for p in runs[True].parameters())  # the translators stay float32


def test_cache_stores_in_the_models_dtype_unless_store_dtype_says(files, tmp_path, capsys):
    from lenskit.io.activations import ActivationDataset

    argv = commands(files, tmp_path)["cache"]
    out = argv.index("--out") + 1
    for extra, folder, want in ((["--dtype", "bf16"], "bf16", torch.bfloat16),
                                (["--dtype", "bf16", "--store-dtype", "fp32"], "fp32", torch.float32)):
        run = [*argv[:out], str(tmp_path / folder), *argv[out + 1:], *extra]
        assert main(run) == 0, capsys.readouterr().err
        assert json.loads((tmp_path / folder / "manifest.json").read_text())["dtype"] == str(want).removeprefix("torch.")
        assert ActivationDataset(tmp_path / folder, "resid_post.0")[0][0].dtype == want
    assert main([*argv, "--store-dtype", "fp61"]) == 2
    assert "--store-dtype fp61 is not a dtype lenskit takes; did you mean 'fp16'?" in capsys.readouterr().err

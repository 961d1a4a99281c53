"""Activation export (`lenskit cache`, lenses.activation_export) and its reader (lenskit.io.activations): the rows
read back are run_with_cache's tensors, a killed export resumes to the same bytes, two processes write what one
does, and a folder of another export, a full disk and bad hook names are refused in one line."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hf_gpt2
from lens_fixtures import write_text_folder, write_tiny_model
from safetensors.torch import save_file

import lenses.activation_export as export_module
from lenses.activation_export import export_activations
from lenses.cli import main
from lenses.evaluation import heldout_windows
from lenskit import HookedTransformer
from lenskit.io.activations import MANIFEST_FILE, ActivationDataset, read_manifest, resolve_hooks
from lenskit.io.data import load_token_stream

HOOKS = "resid_post.1,blocks.0.hook_resid_mid,z.2"
NAMES = ["blocks.1.hook_resid_post", "blocks.0.hook_resid_mid", "blocks.2.attn.hook_z"]


@pytest.fixture(scope="module")
def model() -> HookedTransformer:
    return HookedTransformer.from_hf(make_hf_gpt2())


@pytest.fixture(scope="module")
def windows(model) -> torch.Tensor:
    return torch.randint(0, model.cfg.d_vocab, (7, 12), generator=torch.Generator().manual_seed(0))


def export(model, windows, out, **kw):
    return export_activations(model, windows, kw.pop("hooks", HOOKS), out, windows_per_shard=kw.pop("windows_per_shard", 3),
                              batch=2, progress=False, **kw)


def shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("shard-*.safetensors"))}


def test_export_round_trips_to_run_with_cache(model, windows, tmp_path):
    manifest = export(model, windows, tmp_path / "acts", provenance={"sha256": "abc"})
    assert manifest["hooks"] == NAMES and manifest["n_shards"] == 3 and manifest["complete"]
    assert [s["n_windows"] for s in manifest["shards"]] == [3, 3, 1] and manifest["data"] == {"sha256": "abc"}
    assert read_manifest(tmp_path / "acts") == manifest
    with torch.no_grad():  # the reference: run_with_cache on the same batches of 2 windows, and on all at once
        batches = [model.run_with_cache(windows[i: i + 2], NAMES)[1] for i in range(0, 7, 2)]
        whole = model.run_with_cache(windows, NAMES)[1]
    for name in NAMES:
        rows = ActivationDataset(tmp_path / "acts", name)
        want = torch.cat([c[name] for c in batches])  # [window, pos, *shape]
        assert len(rows) == 7 * 12 and rows.shape == tuple(want.shape[2:]) and rows.dtype == torch.float32
        got = torch.stack([rows[i][0] for i in range(len(rows))]).view(want.shape)
        assert torch.equal(got, want), name
        torch.testing.assert_close(got, whole[name], rtol=1e-5, atol=1e-6)
        assert torch.equal(torch.stack([rows[i][1] for i in range(len(rows))]).view(7, 12), windows)
        acts, tokens = rows.window(4)  # window 4 is the second of shard 1
        assert torch.equal(acts, want[4]) and torch.equal(tokens, windows[4])
    assert ActivationDataset(tmp_path / "acts", "z.2").hook == "blocks.2.attn.hook_z"  # short names read too


def test_rows_shuffle_across_shards_and_batch_in_a_dataloader(model, windows, tmp_path):
    export(model, windows, tmp_path / "acts", hooks="resid_post.0")
    rows = ActivationDataset(tmp_path / "acts")  # one hook: no name needed
    order = rows.shuffled(seed=3)
    assert sorted(order.indices) == list(range(len(rows))) and order.indices != list(range(len(rows)))
    assert rows.shuffled(seed=3).indices == order.indices
    first_shard = 3 * 12
    assert any(i >= first_shard for i in order.indices[:10])  # rows from several shards come early
    acts, tokens = next(iter(torch.utils.data.DataLoader(order, batch_size=10)))
    assert acts.shape == (10, model.cfg.d_model) and tokens.dtype == torch.long
    assert torch.equal(acts[0], rows[order.indices[0]][0])


def test_stored_dtype(model, windows, tmp_path):
    manifest = export(model, windows, tmp_path / "acts", hooks="resid_post.0", dtype=torch.bfloat16)
    assert manifest["dtype"] == "bfloat16"
    rows = ActivationDataset(tmp_path / "acts")
    with torch.no_grad():
        want = model.run_with_cache(windows[:2], "blocks.0.hook_resid_post", dtype=torch.bfloat16)[1]["blocks.0.hook_resid_post"]
    assert rows[0][0].dtype == torch.bfloat16 and torch.equal(rows.window(1)[0], want[1])


def killing_save(after: int):
    """safetensors' save_file that works `after` times, then writes half a file and kills the process."""
    calls = {"n": 0}

    def write(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] <= after:
            return save_file(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(b"\0" * 100)
        os._exit(9)  # no cleanup, no finally: as SIGKILL mid-shard
    return write


def test_a_killed_export_resumes_to_the_same_shards(model, windows, tmp_path):
    clean = export(model, windows, tmp_path / "clean")
    pid = os.fork()
    if pid == 0:  # the child: killed while writing its third shard
        export_module.save_file = killing_save(2)
        try:
            export(model, windows, tmp_path / "killed")
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 9
    killed = tmp_path / "killed"
    assert [s["index"] for s in read_manifest(killed)["shards"]] == [0, 1]
    assert any(p.name.startswith(".shard-00002") for p in killed.iterdir())  # the half-written shard's staging
    with pytest.raises(ValueError, match="unfinished .2 of 3 shards.; rerun"):
        ActivationDataset(killed, "resid_post.1")
    assert len(ActivationDataset(killed, "resid_post.1", allow_incomplete=True)) == 6 * 12
    resumed = export(model, windows, killed)
    assert resumed == clean
    assert shard_bytes(killed) == shard_bytes(tmp_path / "clean")
    assert sorted(p.name for p in killed.iterdir()) == [MANIFEST_FILE, *shard_bytes(killed)]  # no staging, no lock


def filling_disk(after: int):
    calls = {"n": 0}

    def write(tensors, filename, metadata=None):
        calls["n"] += 1
        if calls["n"] <= after:
            return save_file(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(b"\0" * 100)  # half-written
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write


def test_a_full_disk_mid_shard_keeps_the_shards_and_manifest_before_it(model, windows, tmp_path, monkeypatch):
    out = tmp_path / "acts"
    monkeypatch.setattr(export_module, "save_file", filling_disk(1))
    with pytest.raises(OSError) as e:
        export(model, windows, out)
    message = str(e.value)
    assert "shard-00001-rank0.safetensors could not be written" in message and "disk is full" in message
    assert "\n" not in message
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_FILE, "shard-00000-rank0.safetensors"]
    before = (out / MANIFEST_FILE).read_bytes()
    assert [s["index"] for s in json.loads(before)["shards"]] == [0]
    monkeypatch.undo()
    assert export(model, windows, out)["complete"]  # resumes at shard 1
    export(model, windows, tmp_path / "clean")
    assert shard_bytes(out) == shard_bytes(tmp_path / "clean")


def test_a_folder_of_another_export_is_refused_by_name(model, windows, tmp_path):
    out = tmp_path / "acts"
    export(model, windows, out)
    other = HookedTransformer.from_hf(make_hf_gpt2(seed=1))
    with pytest.raises(ValueError, match=r"holds another export: model_fingerprint \(saved 'gpt2:sha256:") as e:
        export(other, windows, out)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"holds another export: hooks .* differ"):
        export(model, windows, out, hooks="resid_post.1")
    with pytest.raises(ValueError, match=r"holds another export: dtype .* differ"):
        export(model, windows, out, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"holds another export: n_windows .*tokens_sha256 .* differ"):
        export(model, windows[:5], out)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files \(todo.txt\) but no manifest.json"):
        export(model, windows, tmp_path / "notes")
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["todo.txt"]


def test_hook_names_short_and_full_and_refusals(model):
    n = model.cfg.n_layers
    assert resolve_hooks(model, "resid_post.1, blocks.0.hook_resid_mid,z2,mlp_out.-1") == [
        "blocks.1.hook_resid_post", "blocks.0.hook_resid_mid", "blocks.2.attn.hook_z", f"blocks.{n - 1}.hook_mlp_out"]
    assert resolve_hooks(model, [f"resid_pre.{n}"]) == [f"blocks.{n - 1}.hook_resid_post"]  # the last stream
    with pytest.raises(KeyError, match="unknown hook name 'resid_pst.1'; did you mean"):
        resolve_hooks(model, "resid_post.1,resid_pst.1")
    with pytest.raises(KeyError, match="'resid_post.9'.* out of range"):
        resolve_hooks(model, "resid_post.9")
    with pytest.raises(ValueError, match="hook_pattern is not one vector per token"):
        resolve_hooks(model, "pattern.0")
    with pytest.raises(ValueError, match="no hooks given"):
        resolve_hooks(model, " , ")


def test_lenskit_cache_command(tmp_path, capsys):
    model_dir = write_tiny_model(tmp_path / "model")
    data = write_text_folder(tmp_path / "data", n=12)
    argv = ["cache", "--model", str(model_dir), "--data", str(data), "--hooks", "resid_post.1,mlp_out.0", "--out",
            str(tmp_path / "acts"), "--ctx", "16", "--windows-per-shard", "4", "--quiet"]
    assert main(argv) == 0
    model = HookedTransformer.from_pretrained(model_dir)
    stream = load_token_stream([data], model.tokenizer)
    windows = heldout_windows(stream, None, 16, model.cfg.n_ctx)
    manifest = read_manifest(tmp_path / "acts")
    assert manifest["data"]["sha256"] == stream.provenance["sha256"] and manifest["n_windows"] == len(windows)
    rows = ActivationDataset(tmp_path / "acts", "mlp_out.0")
    with torch.no_grad():
        want = model.run_with_cache(windows[5:6], "blocks.0.hook_mlp_out")[1]["blocks.0.hook_mlp_out"][0]
    torch.testing.assert_close(rows.window(5)[0], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(rows.window(5)[1], windows[5])
    first = shard_bytes(tmp_path / "acts")
    assert main(argv) == 0 and shard_bytes(tmp_path / "acts") == first  # finished: nothing rewritten
    capsys.readouterr()
    assert main([*argv[:6], "resid_post.7", *argv[7:]]) == 2
    assert "resid_post.7" in capsys.readouterr().err


@pytest.mark.slow  # two fresh processes under torchrun
def test_torchrun_two_processes_write_what_one_does(tmp_path):
    model_dir = write_tiny_model(tmp_path / "model")
    data = write_text_folder(tmp_path / "data", n=12)
    args = ["--model", str(model_dir), "--data", str(data), "--hooks", "resid_post.1,z.0", "--ctx", "16",
            "--windows-per-shard", "3", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "lenses.cli", "cache", *args, "--out", str(tmp_path / "ddp")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "processes: 2" in done.stdout
    assert main(["cache", *args, "--out", str(tmp_path / "one")]) == 0
    ddp, one = read_manifest(tmp_path / "ddp"), read_manifest(tmp_path / "one")
    assert ddp["complete"] and ddp["n_shards"] == one["n_shards"] >= 3
    assert [s["rank"] for s in ddp["shards"]] == [k % 2 for k in range(ddp["n_shards"])]
    assert {k: v for k, v in ddp.items() if k != "shards"} == {k: v for k, v in one.items() if k != "shards"}
    for a, b in zip(ddp["shards"], one["shards"]):  # the same bytes shard by shard, under another rank's name
        assert a["file"] == b["file"].replace("rank0", f"rank{a['rank']}")
        assert (tmp_path / "ddp" / a["file"]).read_bytes() == (tmp_path / "one" / b["file"]).read_bytes()
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == [MANIFEST_FILE, *(s["file"] for s in ddp["shards"])]


def test_ctrl_c_keeps_the_shards_written_and_the_same_command_resumes(tmp_path, capsys, monkeypatch):
    model_dir = write_tiny_model(tmp_path / "model")
    data = write_text_folder(tmp_path / "data", n=12)
    argv = ["cache", "--model", str(model_dir), "--data", str(data), "--hooks", "resid_post.0", "--out",
            str(tmp_path / "acts"), "--ctx", "16", "--windows-per-shard", "4", "--quiet"]
    real, calls = export_module._shard, {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(export_module, "_shard", interrupted)
    assert main(argv) == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "interrupted" in err[0] and "run the same command to resume" in err[0], err
    assert [s["index"] for s in read_manifest(tmp_path / "acts")["shards"]] == [0, 1]
    monkeypatch.undo()
    assert main(argv) == 0 and read_manifest(tmp_path / "acts")["complete"]


def test_a_manifest_that_is_not_a_regular_file_is_refused(model, windows, tmp_path):
    out = tmp_path / "acts"
    out.mkdir()
    os.mkfifo(out / MANIFEST_FILE)
    with pytest.raises(OSError, match="not a regular file but a FIFO"):
        export(model, windows, out)
    (out / MANIFEST_FILE).unlink()
    (out / MANIFEST_FILE).write_text('{"format": "lenskit-activations", "format_version": 1}')
    with pytest.raises(ValueError, match="field 'model_fingerprint' must be .* found missing; the export is corrupt"):
        export(model, windows, out)


def test_ranks_record_their_shards_and_a_run_of_another_size_finishes_the_export(model, windows, tmp_path, monkeypatch):
    """The bookkeeping of two ranks, one after the other in this process (barriers stubbed): rank 0 lists its
    shards in manifest.json, rank 1 in its own record; a one-process rerun then lists them all and writes nothing."""
    import types

    clean = export(model, windows, tmp_path / "clean")
    out = tmp_path / "acts"
    monkeypatch.setattr(export_module, "dist", types.SimpleNamespace(barrier=lambda: None))
    monkeypatch.setattr(export_module, "distributed", lambda: (0, 2))
    export(model, windows, out)
    assert [s["index"] for s in read_manifest(out)["shards"]] == [0, 2]
    monkeypatch.setattr(export_module, "distributed", lambda: (1, 2))
    export(model, windows, out)
    assert [s["file"] for s in json.loads((out / "manifest-rank1.json").read_text())["shards"]] == ["shard-00001-rank1.safetensors"]
    monkeypatch.undo()
    written = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}
    manifest = export(model, windows, out)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")} == written  # nothing rewritten
    assert manifest["complete"] and [s["rank"] for s in manifest["shards"]] == [0, 1, 0]
    assert not (out / "manifest-rank1.json").exists()
    assert {k: v for k, v in manifest.items() if k != "shards"} == {k: v for k, v in clean.items() if k != "shards"}
    for a, b in zip(manifest["shards"], clean["shards"]):
        assert (out / a["file"]).read_bytes() == (tmp_path / "clean" / b["file"]).read_bytes()

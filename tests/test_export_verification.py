"""Exports verify what they serve (lenskit.io.activations.shard_problem): a shard whose bytes, name, place,
windows or record are wrong is never served, a rerun of the export writes it again, integer hooks read back as
integers, and a hook's layout, not its first two sizes, decides whether it exports as rows."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from families import family_model_of
from test_activation_export import model, windows  # noqa: F401 - the same tiny GPT-2 and windows, one home

import lenskit.observe.names as names_module
from lenses.activation_export import export_activations, rank_record
from lenskit.io import activations as acts_module
from lenskit.io.activations import MANIFEST_FILE, ActivationDataset, file_checksum, read_manifest, resolve_hooks

HOOK = "blocks.1.hook_resid_post"


def export(model, windows, out, hooks=HOOK, **kw):
    return export_activations(model, windows, hooks, out, windows_per_shard=3, batch=2, progress=False, **kw)


@pytest.fixture
def done(model, windows, tmp_path):
    """A finished export in tmp_path/acts and its shards' bytes."""
    export(model, windows, tmp_path / "acts")
    return tmp_path / "acts", {p.name: p.read_bytes() for p in (tmp_path / "acts").glob("shard-*")}


def edit_manifest(folder: Path, change) -> None:
    m = json.loads((folder / MANIFEST_FILE).read_text())
    change(m)
    (folder / MANIFEST_FILE).write_text(json.dumps(m))


def every_row(folder: Path) -> torch.Tensor:
    rows = ActivationDataset(folder, HOOK)
    return torch.stack([rows[i][0] for i in range(len(rows))])


def rerun_heals(model, windows, folder: Path, before: dict[str, bytes], capsys, why: str) -> None:
    """The same export again says in one line that it writes the failing shards again, and ends with the bytes
    of the first run, every row served."""
    capsys.readouterr()
    export(model, windows, folder)
    lines = [line for line in capsys.readouterr().out.splitlines() if "fail verification" in line]
    assert len(lines) == 1 and why in lines[0] and "writing them again" in lines[0], lines
    assert {p.name: p.read_bytes() for p in folder.glob("shard-*")} == before
    assert len(every_row(folder)) == 7 * 12


def test_a_shard_rewritten_with_the_same_size_is_refused_and_a_rerun_writes_it_again(model, windows, done, capsys):
    folder, before = done
    path = folder / "shard-00001-rank0.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one byte of activations: same size, same header
    path.write_bytes(bytes(data))
    rows = ActivationDataset(folder, HOOK)
    assert rows[0][0].shape == (32,)  # shard 0 is fine and served
    with pytest.raises(ValueError, match="shard 1 fails verification: its checksum differs.*rerun the same"):
        rows[3 * 12]
    rerun_heals(model, windows, folder, before, capsys, "checksum differs")


def test_two_records_naming_one_shard_are_refused_and_a_rerun_rewrites_them(model, windows, done, capsys):
    folder, before = done
    edit_manifest(folder, lambda m: m["shards"].append(dict(m["shards"][0])))  # shard 0 listed twice
    with pytest.raises(ValueError, match="two shard records name shard 0, so its rows would be read twice"):
        ActivationDataset(folder, HOOK)

    def point_1_at_0(m):  # shard 1's record names shard 0's file (the windows it claims are shard 1's)
        m["shards"] = [m["shards"][0], {**m["shards"][0], "index": 1, "first_window": 3}, m["shards"][2]]
    edit_manifest(folder, point_1_at_0)
    with pytest.raises(ValueError, match="shard 1 fails verification: its file 'shard-00000-rank0.safetensors' is not"):
        every_row(folder)
    rerun_heals(model, windows, folder, before, capsys, "is not 'shard-00001-rank0.safetensors'")


def test_swapped_shards_are_caught_by_their_windows_even_with_matching_checksums(model, windows, done, capsys):
    folder, before = done
    a, b = folder / "shard-00000-rank0.safetensors", folder / "shard-00001-rank0.safetensors"
    a.rename(folder / "tmp"), b.rename(a), (folder / "tmp").rename(b)

    def follow(m):  # records that agree with the swapped files' sizes and checksums: only `windows` can tell
        for s in m["shards"][:2]:
            s["bytes"], s["checksum"] = (folder / s["file"]).stat().st_size, file_checksum(folder / s["file"])
    edit_manifest(folder, follow)
    with pytest.raises(ValueError, match="shard 0 fails verification: its windows tensor is not windows 0..2"):
        ActivationDataset(folder, HOOK)[0]
    rerun_heals(model, windows, folder, before, capsys, "windows tensor is not windows")


@pytest.mark.skipif(os.name == "nt", reason="symlinks")
def test_links_and_paths_out_of_the_folder_are_never_served(model, windows, done, tmp_path, capsys):
    folder, before = done
    outside = tmp_path / "outside.safetensors"
    shutil.copy(folder / "shard-00002-rank0.safetensors", outside)
    (folder / "shard-00002-rank0.safetensors").unlink()
    (folder / "shard-00002-rank0.safetensors").symlink_to(outside)  # the very bytes, through a link
    with pytest.raises(ValueError, match="shard 2 fails verification: its file is not a regular file"):
        ActivationDataset(folder, HOOK)[6 * 12]
    edit_manifest(folder, lambda m: m["shards"][2].update(file=".."))
    with pytest.raises(ValueError, match=r"shard 2 fails verification: its file '\.\.' is not"):
        ActivationDataset(folder, HOOK)[6 * 12]
    rerun_heals(model, windows, folder, before, capsys, "shard-00002-rank0.safetensors")
    assert not (folder / "shard-00002-rank0.safetensors").is_symlink() and outside.read_bytes() == before[
        "shard-00002-rank0.safetensors"]  # the link was replaced, its target left alone


def test_a_cut_shard_is_one_line_not_a_safetensors_error(model, windows, done, capsys):
    folder, before = done
    path = folder / "shard-00000-rank0.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="shard 0 fails verification: its file has 100 bytes, the record"):
        ActivationDataset(folder, HOOK)[0]
    rerun_heals(model, windows, folder, before, capsys, "has 100 bytes")


def test_a_rank_record_naming_a_file_outside_the_folder_is_not_taken_as_finished(model, windows, done, tmp_path, capsys):
    folder, before = done
    record = read_manifest(folder)["shards"][1]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(folder / record["file"], outside)
    edit_manifest(folder, lambda m: m.update(shards=[m["shards"][0], m["shards"][2]], complete=False))
    (folder / record["file"]).unlink()
    escaped = {**record, "rank": 1, "file": f"../{outside.name}"}
    (folder / rank_record(1)).write_text(json.dumps({"shards": [escaped]}))
    rerun_heals(model, windows, folder, before, capsys, "../elsewhere.safetensors")
    assert read_manifest(folder)["complete"] and not (folder / rank_record(1)).exists()
    assert [s["file"] for s in read_manifest(folder)["shards"]] == sorted(before)


def test_each_shard_is_verified_once_per_reader(done, monkeypatch):
    folder, _ = done
    calls = []
    real = acts_module.file_checksum
    monkeypatch.setattr(acts_module, "file_checksum", lambda path: calls.append(Path(path).name) or real(path))
    rows = ActivationDataset(folder, HOOK)
    for i in range(len(rows)):
        rows[i]
    assert sorted(calls) == sorted(s["file"] for s in rows.shards)


def test_an_export_of_format_1_reads_with_a_warning_and_is_not_resumed(model, windows, done):
    folder, _ = done
    want = every_row(folder)

    def old(m):
        m["format_version"] = 1
        del m["dtypes"]
        for s in m["shards"]:
            del s["checksum"]
    edit_manifest(folder, old)
    with pytest.warns(UserWarning, match="activation format 1, whose records have no checksums"):
        assert torch.equal(every_row(folder), want)
    with pytest.raises(ValueError, match=r"holds another export: format_version \(saved 1, now 2\)"):
        export(model, windows, folder)


@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_expert_indices_export_and_read_back_as_integers(dtype, tmp_path):
    model = family_model_of("olmoe").model
    tokens = torch.randint(0, model.cfg.d_vocab, (5, 8), generator=torch.Generator().manual_seed(1))
    hooks = ["blocks.1.mlp.hook_expert_indices", "blocks.1.mlp.hook_expert_weights"]
    manifest = export(model, tokens, tmp_path / "acts", hooks=hooks, dtype=dtype)
    assert manifest["dtypes"] == {hooks[0]: "int64", hooks[1]: "float16" if dtype else "float32"}
    _, cache = model.run_with_cache(tokens, hooks)
    for name in hooks:
        rows = ActivationDataset(tmp_path / "acts", name)
        got = torch.stack([rows[i][0] for i in range(len(rows))]).view(cache[name].shape)
        assert got.dtype == (torch.int64 if "indices" in name else dtype or torch.float32)
        assert torch.equal(got, cache[name].to(got.dtype))
    assert export(model, tokens, tmp_path / "acts", hooks=hooks, dtype=dtype)["complete"]  # a rerun takes it as done


def test_a_per_state_hook_is_refused_by_its_layout_when_its_heads_equal_the_window(monkeypatch, tmp_path):
    model = family_model_of("qwen3_5_text").model  # 4 value heads: hook_state is [batch, 4, d_k, d_v]
    tokens = torch.randint(0, model.cfg.d_vocab, (2, 4), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"blocks.0.attn.hook_state is not one vector per token \(it is per-state"):
        resolve_hooks(model, "blocks.0.attn.hook_state")
    with pytest.raises(ValueError, match=r"hook_pattern is not one vector per token \(it is per-head"):
        resolve_hooks(model, "pattern.1")
    # Undeclared (a layout table that forgot it), the probe still sees that its second axis is not the position.
    monkeypatch.setattr(names_module, "LAYOUTS", {})
    with pytest.raises(ValueError, match=r"hook_state gives shape \(1, 4, 8, 6\) for windows of \(1, 3\), not \[batch"):
        export(model, tokens, tmp_path / "acts", hooks="blocks.0.attn.hook_state")
    assert not (tmp_path / "acts" / MANIFEST_FILE).exists()

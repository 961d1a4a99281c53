"""A hub name resolves only inside the hub cache (lenskit/io/hubcache.py): a ref must be a commit hash or a
plain name, and the snapshot, and every link in it, must stay in the repo's folder and its `blobs/`.
Each test writes its own cache under tmp_path (HF_HUB_CACHE); nothing touches the network."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_hf_gpt2
from forked import run_forked
from gpt2_layouts import layout_bare_tied
from test_hub import HASH, fake_hub_cache, offline  # noqa: F401 - offline is a fixture

from lenses.tuned import TunedLens
from lenskit import HookedTransformer
from lenskit.io.hubcache import HubCacheError
from lenskit.io.loading import resolve_hub_file, resolve_model_folder

pytestmark = pytest.mark.skipif(os.name != "posix", reason="symlinks and FIFOs are POSIX")

REPOS = ["openai-community/gpt2", "someone/tiny-model"]


@pytest.fixture(scope="module")
def hf():
    return make_hf_gpt2(n_layer=2, n_embd=32, n_head=4, vocab_size=101, n_positions=64, seed=5)


@pytest.fixture
def cache(tmp_path, offline):  # noqa: F811 - the fixture imported above
    monkeypatch, _ = offline
    root = tmp_path / "hf" / "hub"
    root.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def repo_dir(cache: Path, repo_id: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}"


def as_blobs(snapshot: Path) -> None:
    """Lay the snapshot out as huggingface_hub does: every file a relative symlink into ../../blobs/."""
    blobs = snapshot.parent.parent / "blobs"
    blobs.mkdir(exist_ok=True)
    for f in sorted(snapshot.iterdir()):
        blob = blobs / f"blob-{f.name}"
        shutil.move(f, blob)
        f.symlink_to(os.path.relpath(blob, snapshot))


@pytest.mark.parametrize("repo_id", REPOS)
def test_a_well_formed_cache_with_blob_links_loads(hf, cache, repo_id):
    snapshot = fake_hub_cache(hf, cache, repo_id)
    as_blobs(snapshot)
    model = HookedTransformer.from_pretrained(repo_id)
    tokens = torch.randint(0, 101, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(tokens), hf(tokens).logits, atol=1e-4)


def outside_model(hf, tmp_path: Path) -> Path:
    """A valid model folder outside the cache, which an escaping ref or link would load."""
    folder = tmp_path / "outside"
    layout_bare_tied(hf, folder)
    return folder


@pytest.mark.parametrize("repo_id, name", [("openai-community/gpt2", "gpt2"), ("openai-community/gpt2", "openai-community/gpt2"),
                                           ("someone/tiny-model", "someone/tiny-model")])
def test_a_ref_that_climbs_out_of_the_cache_is_refused(hf, cache, tmp_path, repo_id, name):
    outside = outside_model(hf, tmp_path)
    snapshot = fake_hub_cache(hf, cache, repo_id)
    ref = snapshot.parent.parent / "refs" / "main"
    ref.write_text(os.path.relpath(outside, snapshot.parent))  # ../../../../outside: what huggingface_hub would join
    assert (snapshot.parent / ref.read_text()).resolve() == outside.resolve()  # the attack is real
    with pytest.raises(HubCacheError) as info:
        HookedTransformer.from_pretrained(name)
    message = str(info.value)
    assert "refs/main" in message and "commit hash" in message and "\n" not in message, message


@pytest.mark.parametrize("content", [str(Path("/etc")), "main/../../x", "..", ".hidden", "0123\n", "a" * 300])
def test_a_ref_must_be_a_commit_hash_or_a_plain_name(hf, cache, content):
    snapshot = fake_hub_cache(hf, cache, "someone/tiny-model")
    (snapshot.parent.parent / "refs" / "main").write_text(content)
    with pytest.raises(HubCacheError, match="refs/main"):
        resolve_model_folder("someone/tiny-model")


def test_a_plain_name_ref_is_accepted(hf, cache):
    snapshot = fake_hub_cache(hf, cache, "someone/tiny-model")
    snapshot.rename(snapshot.parent / "v1.0-release")
    (snapshot.parent.parent / "refs" / "main").write_text("v1.0-release")
    assert resolve_model_folder("someone/tiny-model").name == "v1.0-release"


def test_a_fifo_ref_does_not_hang(hf, cache):
    snapshot = fake_hub_cache(hf, cache, "someone/tiny-model")
    ref = snapshot.parent.parent / "refs" / "main"
    ref.unlink()
    os.mkfifo(ref)
    run_forked(lambda: resolve_model_folder("someone/tiny-model"), 30).raised("HubCacheError", "refs/main", "not a regular file")


@pytest.mark.parametrize("entry", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_snapshot_link_that_points_outside_blobs_is_refused(hf, cache, tmp_path, entry):
    outside = outside_model(hf, tmp_path)
    snapshot = fake_hub_cache(hf, cache, "someone/tiny-model")
    as_blobs(snapshot)
    target = outside / entry
    if not target.exists():
        target.write_text("{}")
    (snapshot / entry).unlink(missing_ok=True)
    (snapshot / entry).symlink_to(target)
    with pytest.raises(HubCacheError) as info:
        HookedTransformer.from_pretrained("someone/tiny-model")
    message = str(info.value)
    assert entry in message and "outside" in message and "blobs" in message and "\n" not in message, message


def test_links_into_another_repos_blobs_or_into_a_subfolder_are_refused(hf, cache, tmp_path):
    other = fake_hub_cache(hf, cache, "someone/other")
    as_blobs(other)
    snapshot = fake_hub_cache(hf, cache, "someone/tiny-model")
    as_blobs(snapshot)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(next((other.parent.parent / "blobs").glob("blob-model*")))
    with pytest.raises(HubCacheError, match="model.safetensors.*outside"):
        resolve_model_folder("someone/tiny-model")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(next((snapshot.parent.parent / "blobs").glob("blob-model*")))
    assert resolve_model_folder("someone/tiny-model") == snapshot.resolve()
    (snapshot / "sub").symlink_to(tmp_path, target_is_directory=True)  # a linked folder, never followed by the walk
    with pytest.raises(HubCacheError, match="sub.*outside"):
        resolve_model_folder("someone/tiny-model")


def test_a_snapshot_folder_that_is_itself_a_link_outside_is_refused(hf, cache, tmp_path):
    outside = outside_model(hf, tmp_path)
    snapshot = fake_hub_cache(hf, cache, "someone/tiny-model")
    shutil.rmtree(snapshot)
    snapshot.symlink_to(outside, target_is_directory=True)
    with pytest.raises(HubCacheError, match="snapshot resolves to .*outside"):
        HookedTransformer.from_pretrained("someone/tiny-model")


def test_lens_hub_ids_and_single_hub_files_get_the_same_checks(hf, cache, tmp_path):
    model = HookedTransformer.from_hf(hf)
    lens_repo = repo_dir(cache, "someone/tiny-lens")
    snapshot = lens_repo / "snapshots" / HASH
    TunedLens(model).save(snapshot)
    (lens_repo / "refs").mkdir()
    (lens_repo / "refs" / "main").write_text(HASH)
    (lens_repo / "blobs").mkdir()
    assert TunedLens.load("someone/tiny-lens", model).n_layers == 2  # well formed: loads
    assert resolve_hub_file("someone/tiny-lens", "config.json") == snapshot.resolve() / "config.json"
    outside = tmp_path / "elsewhere"
    TunedLens(model).save(outside)
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(outside / "config.json")
    with pytest.raises(HubCacheError, match="config.json.*outside"):
        TunedLens.load("someone/tiny-lens", model)
    with pytest.raises(HubCacheError, match="config.json.*outside"):
        resolve_hub_file("someone/tiny-lens", "config.json")
    (lens_repo / "refs" / "main").write_text("../../../../elsewhere")
    with pytest.raises(HubCacheError, match="refs/main"):
        resolve_hub_file("someone/tiny-lens", "config.json")
    assert json.loads((outside / "config.json").read_text())  # nothing was changed outside

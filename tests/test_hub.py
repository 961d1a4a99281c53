"""Hub names resolve through the local Hugging Face cache, and offline an uncached name says what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_hf_gpt2
from golden import assert_golden
from lenskit import HookedTransformer
from test_loading import layout_bare_tied


@pytest.fixture(scope="module")
def hf():
    return make_hf_gpt2(n_layer=3, n_embd=32, n_head=4, vocab_size=101, n_positions=64, seed=11)


@pytest.fixture
def batch():
    return torch.randint(0, 71, (2, 15), generator=torch.Generator().manual_seed(2))


HASH = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(hf_model, cache: Path, repo_id: str = "openai-community/gpt2") -> Path:
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(HASH)
    snapshot = repo / "snapshots" / HASH
    layout_bare_tied(hf_model, snapshot)
    (repo / "blobs").mkdir()
    return snapshot


@pytest.fixture
def offline(monkeypatch, tmp_path):
    import huggingface_hub

    monkeypatch.chdir(tmp_path)  # a folder named like the hub id in the cwd would win
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    real = huggingface_hub.snapshot_download
    calls = []

    def local_only(*args, **kwargs):
        calls.append(kwargs)
        assert kwargs.get("local_files_only"), "offline, nothing may try the network"
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", local_only)
    return monkeypatch, calls


@pytest.mark.parametrize("name", ["gpt2", "openai-community/gpt2"])
@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME"])
def test_hub_name_resolves_from_local_cache(hf, tmp_path, offline, name, env, batch):
    monkeypatch, calls = offline
    root = tmp_path / "hf-home"
    cache = root / "hub" if env == "HF_HOME" else root
    fake_hub_cache(hf, cache)
    monkeypatch.setenv(env, str(root))
    model = HookedTransformer.from_pretrained(name)
    assert calls and model.cfg.d_model == 32
    assert_golden(model, hf, batch)


def test_uncached_hub_name_offline_says_pass_a_folder(tmp_path, offline):
    monkeypatch, calls = offline
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(OSError, match=r"gpt2-medium.*not a local folder.*not in the local Hugging Face cache.*Pass a local folder"):
        HookedTransformer.from_pretrained("gpt2-medium")
    assert calls and all(c.get("local_files_only") for c in calls)
    with pytest.raises(OSError, match="HF_HUB_OFFLINE"):
        HookedTransformer.from_pretrained("someone/some-model")

"""Hub names resolve through the local Hugging Face cache, and offline an uncached name says what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_hf_gpt2
from golden import assert_golden
from gpt2_layouts import layout_bare_tied

from lenskit import HookedTransformer


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


def llama3_style_tokenizer():
    """A tiny BPE whose tokenizer.json adds <|begin_of_text|> itself, as Llama 3's does."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:60])
    tok.train_from_iterator(["hello world " * 20, "the cat sat " * 20], trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                                eos_token="<|end_of_text|>")


@pytest.mark.parametrize("repo_id, family", [("EleutherAI/pythia-160m", "gpt_neox"),
                                             ("meta-llama/Llama-3.2-1B", "llama"), ("Qwen/Qwen3-0.6B", "qwen3")])
def test_family_hub_names_resolve_from_local_cache(tmp_path, offline, repo_id, family, batch):
    from conftest import make_hf_family

    monkeypatch, calls = offline
    hf = make_hf_family(family, seed=7)
    snapshot = tmp_path / "cache" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / HASH
    hf.save_pretrained(snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(HASH)
    if family == "llama":
        llama3_style_tokenizer().save_pretrained(str(snapshot))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    model = HookedTransformer.from_pretrained(repo_id)
    assert calls and all(c.get("local_files_only") for c in calls)
    assert model.cfg.family == family
    assert_golden(model, hf, batch)
    if family == "llama":
        bos = model.tokenizer.bos_token_id
        tokens = model.to_tokens("hello world")
        assert tokens[0, 0] == bos and tokens[0, 1] != bos  # the tokenizer's own habit: one BOS, first
        assert model.to_tokens("hello world", prepend_bos=False).tolist() == [tokens[0, 1:].tolist()]
        assert model.tokenizer("hello world")["input_ids"] == tokens[0].tolist()  # same ids as transformers gives


def test_gpt2_style_tokenizer_gets_no_bos_by_default():
    from tiny_tokenizer import make_model_with_tokenizer

    model = make_model_with_tokenizer()
    bos = model.tokenizer.bos_token_id
    assert model.to_tokens("def f")[0, 0] != bos
    assert model.to_tokens("def f", prepend_bos=True)[0, 0] == bos

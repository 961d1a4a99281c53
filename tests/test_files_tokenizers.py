"""Failures inside `tokenizers` name the file (a broken tokenizer.json, a panic while tokenizing a prompt or a data
document), and a device torch cannot use is one line before any file is read. The files are tests/user_files.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from user_files import base, copy_with  # noqa: F401 - base is a fixture

from lenskit import HookedTransformer
from lenskit.io.data import load_token_stream


# ------------------------------------------------------------------------------------------ tokenizers' errors
def edit_tokenizer_json(folder: Path, edit) -> None:
    data = json.loads((folder / "tokenizer.json").read_text())
    edit(data)
    (folder / "tokenizer.json").write_text(json.dumps(data))


def unknown_model_type(data):
    data["model"]["type"] = "Frobnicate"


def vocab_as_list(data):
    data["model"]["vocab"] = [1, 2, 3]


BROKEN_TOKENIZERS = [
    ("tokenizer.json unknown model type", lambda f: edit_tokenizer_json(f, unknown_model_type), "tokenizer.json", "BPE, WordPiece"),
    ("tokenizer.json vocab a list", lambda f: edit_tokenizer_json(f, vocab_as_list), "tokenizer.json", "expected"),
    ("corrupt vocab.json", lambda f: ((f / "tokenizer.json").unlink(), (f / "vocab.json").write_text('{"a": 1, "b": ')),
     "vocab.json", "not valid JSON"),
    ("vocab.json of strings", lambda f: ((f / "tokenizer.json").unlink(), (f / "vocab.json").write_text('{"a": "1"}')),
     "vocab.json", "not an integer id"),
    ("corrupt merges.txt", lambda f: ((f / "tokenizer.json").unlink(), (f / "merges.txt").write_bytes(b"#version: 0.2\nabc\n")),
     "merges.txt", "merges.txt"),
]


@pytest.mark.parametrize("name, breaks, file, words", BROKEN_TOKENIZERS, ids=[c[0] for c in BROKEN_TOKENIZERS])
def test_tokenizer_files_that_fail_inside_tokenizers_name_the_file(base, tmp_path, name, breaks, file, words):
    folder = copy_with(base["gpt2"], tmp_path / "m")
    breaks(folder)
    with pytest.raises(ValueError) as info:
        HookedTransformer.from_pretrained(folder)
    message = str(info.value)
    assert file in message and words in message and "\n" not in message, message
    assert type(info.value) is not Exception  # not the bare Exception tokenizers raises


@pytest.fixture(scope="module")
def catastrophic(base, tmp_path_factory) -> HookedTransformer:
    """A model whose tokenizer.json splits text with `^(a+)+$`: a regex that runs past oniguruma's retry limit on
    a long run of a's, which tokenizers turns into a Rust panic (pyo3's PanicException, a BaseException)."""
    folder = copy_with(base["gpt2"], tmp_path_factory.mktemp("regex") / "m")

    def edit(data):
        split = {"type": "Split", "pattern": {"Regex": "^(a+)+$"}, "behavior": "Isolated", "invert": False}
        data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, data["pre_tokenizer"]]}

    edit_tokenizer_json(folder, edit)
    return HookedTransformer.from_pretrained(folder)


BAD_TEXT = "a" * 40 + "!"


@pytest.mark.parametrize("call", ["to_tokens", "forward", "to_single_token"])
def test_a_panic_inside_tokenizers_is_one_value_error(catastrophic, call):
    assert catastrophic.to_tokens("hello").shape[0] == 1  # the tokenizer works on ordinary text
    run = {"to_tokens": catastrophic.to_tokens, "forward": catastrophic, "to_single_token": catastrophic.to_single_token}[call]
    with pytest.raises(ValueError) as info:  # a PanicException would not even be an Exception
        run(BAD_TEXT)
    message = str(info.value)
    assert "retry-limit" in message and "regex" in message and "\n" not in message, message


def test_a_panic_while_tokenizing_data_names_the_document(catastrophic, tmp_path):
    (tmp_path / "ok.txt").write_text("def f(x):\n    return x\n")
    (tmp_path / "zz_bad.txt").write_text(BAD_TEXT)
    with pytest.raises(ValueError, match=r"failed while encoding .*ok.txt.*retry-limit"):
        load_token_stream([tmp_path], catastrophic.tokenizer)


# ------------------------------------------------------------------------------------------ devices
@pytest.mark.parametrize("device, words", [
    pytest.param("cuda", ("device='cuda'", "without CUDA", "device='cpu'"),
                 marks=pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch")),
    pytest.param("cuda:1", ("device='cuda:1'", "CUDA"),
                 marks=pytest.mark.skipif(torch.cuda.device_count() > 1, reason="two GPUs are there")),
    ("gpu", ("device='gpu'", "not a device torch knows")),
    (3.5, ("device=3.5", "not a device")),
])
def test_a_device_torch_cannot_use_is_one_line_before_any_file_is_read(tmp_path, device, words):
    with pytest.raises(ValueError) as info:
        HookedTransformer.from_pretrained(tmp_path / "nowhere", device=device)  # the device is checked first
    message = str(info.value)
    assert all(w in message for w in words) and "\n" not in message, message

"""lenskit.io.data: files, folders and JSONL become one token stream with exact provenance."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from lens_fixtures import sample_texts, tiny_tokenizer

from lenskit.io.data import list_files, load_token_stream, read_documents, window_order


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"), sample_texts())


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / "a.py").write_text("import os\n")
    (root / "b" / "c.txt").write_text("hello world\n")
    (root / "b" / "d.md").write_text("# title é\n")
    (root / "image.png").write_bytes(b"\x89PNG not text")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.py").write_text("secret = 1\n")
    return root


def test_folder_lists_text_files_in_sorted_relative_order(corpus):
    files = [f.relative_to(corpus).as_posix() for f in list_files([corpus])]
    assert files == ["a.py", "b/c.txt", "b/d.md"]  # no .png, nothing hidden


def test_provenance_records_every_file_with_size_and_sha256(corpus):
    docs, prov = read_documents([corpus])
    assert [d.text for d in docs] == ["import os\n", "hello world\n", "# title é\n"]
    for record, name in zip(prov["files"], ["a.py", "b/c.txt", "b/d.md"]):
        raw = (corpus / name).read_bytes()
        assert record["path"].endswith(name)
        assert record["bytes"] == len(raw)
        assert record["sha256"] == hashlib.sha256(raw).hexdigest()
    assert prov["n_files"] == 3 and prov["bytes"] == sum(r["bytes"] for r in prov["files"])
    # The combined hash changes when any file's content changes.
    (corpus / "b" / "c.txt").write_text("hello world!\n")
    assert read_documents([corpus])[1]["sha256"] != prov["sha256"]


def test_jsonl_reads_the_text_field_and_names_bad_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "one", "id": 1}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    docs, _ = read_documents([path])
    assert [d.text for d in docs] == ["one", "two"]
    assert docs[1].source.endswith("d.jsonl:3")
    path.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:1 has no string field 'text'"):
        read_documents([path])
    assert [d.text for d in read_documents([path], text_field="body")[0]] == ["x"]
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:1 is not valid JSON"):
        read_documents([path])


def test_missing_path_and_empty_folder_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_files([tmp_path / "nope"])
    with pytest.raises(FileNotFoundError, match="holds no text files"):
        list_files([tmp_path])


def test_stream_is_each_document_then_eos(corpus, tokenizer):
    stream = load_token_stream([corpus / "a.py", corpus / "b"], tokenizer)
    texts = ["import os\n", "hello world\n", "# title é\n"]
    expected = []
    for t in texts:
        expected += tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert stream.tokens.tolist() == expected
    assert stream.n_bytes == sum(len(t.encode()) for t in texts)
    assert stream.provenance["n_tokens"] == len(expected)


def test_windows_are_non_overlapping_and_drop_the_tail(corpus, tokenizer):
    stream = load_token_stream([corpus], tokenizer)
    n = len(stream)
    w = stream.windows(4)
    assert w.shape == (n // 4, 4)
    assert torch.equal(w.flatten(), stream.tokens[: n // 4 * 4])
    with pytest.raises(ValueError, match="fewer than one window"):
        stream.windows(n + 1)


def test_window_order_is_a_seeded_permutation():
    a, b, c = window_order(50, 3), window_order(50, 3), window_order(50, 4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert sorted(a.tolist()) == list(range(50))

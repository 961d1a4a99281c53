"""Weights under a loaded model (lenskit/io/mapped.py): a memory-mapped weights file written in place or
truncated since load is refused before the next forward, a file replaced by rename is not (the mapping
keeps the old file), and `from_pretrained(..., mmap=False)` reads the weights into memory."""

from __future__ import annotations

import copy
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import make_hf_family
from forked import run_forked
from safetensors.torch import load_file, save_file
from tiny_tokenizer import save_tiny_model

from lenskit import HookedTransformer
from lenskit.io.mapped import WeightsChangedError

CHANGED = "weights file changed since load; reload the model"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mapped")
    llama = root / "llama"
    make_hf_family("llama", tie_word_embeddings=False).save_pretrained(llama, max_shard_size="20KB")
    return {"gpt2": save_tiny_model(root / "gpt2"), "llama": llama}


@pytest.fixture(params=["gpt2", "llama"])
def folder(request, source, tmp_path) -> Path:
    dst = tmp_path / request.param
    shutil.copytree(source[request.param], dst)
    return dst


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def tokens_for(model: HookedTransformer) -> torch.Tensor:
    return torch.randint(0, model.cfg.d_vocab, (1, 9), generator=torch.Generator().manual_seed(0))


def overwrite_in_place(path: Path) -> None:
    """Rewrite the tensor bytes of a safetensors file in place (same inode, same size), as an editor would."""
    time.sleep(0.02)  # past the file system's timestamp granularity, so the write moves st_mtime_ns
    header = int.from_bytes(path.read_bytes()[:8], "little")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(8 + header)
        f.write(torch.full((1024,), 0.25).numpy().tobytes()[: size - 8 - header])  # finite float32 values


def test_a_file_written_in_place_is_refused_before_the_next_forward(folder):
    model = HookedTransformer.from_pretrained(folder)
    assert model.weight_files, "a same-dtype CPU load maps its files, and watches them"
    tokens = tokens_for(model)
    before = model(tokens)
    target = weight_files(folder)[-1]
    overwrite_in_place(target)
    for call in (lambda: model(tokens), lambda: model.run_with_cache(tokens), lambda: model.generate(tokens, max_new_tokens=2)):
        with pytest.raises(WeightsChangedError) as info:
            call()
        message = str(info.value)
        assert message.startswith(CHANGED) and target.name in message and "mmap=False" in message and "\n" not in message
    assert torch.isfinite(before).all()


def test_a_truncated_file_is_refused_not_a_sigbus(folder):
    def run():
        model = HookedTransformer.from_pretrained(folder)
        tokens = tokens_for(model)
        model(tokens)
        target = max(weight_files(folder), key=lambda p: p.stat().st_size)
        os.truncate(target, 64)  # the forward would touch pages past the new end: SIGBUS
        return model(tokens)

    run_forked(run, 60).raised("WeightsChangedError", CHANGED)


def test_a_file_replaced_by_rename_is_not_refused_and_the_model_is_unchanged(folder):
    """The descriptor follows the mapped inode: writing a new file and renaming it over the old (what
    save_file, save_pretrained and the hub download do) leaves the model's pages as they were."""
    model = HookedTransformer.from_pretrained(folder)
    tokens = tokens_for(model)
    before = model(tokens)
    for path in weight_files(folder):
        zeros = {k: torch.zeros_like(v) for k, v in load_file(path).items()}
        save_file(zeros, path.with_suffix(".tmp"), metadata={"format": "pt"})
        os.replace(path.with_suffix(".tmp"), path)
    assert torch.equal(model(tokens), before)
    model.save_pretrained(folder)  # saving a model over the folder it maps
    assert torch.equal(model(tokens), before)
    assert torch.equal(HookedTransformer.from_pretrained(folder)(tokens), before)


def test_mmap_false_reads_the_weights_into_memory(folder):
    model = HookedTransformer.from_pretrained(folder, mmap=False)
    assert model.weight_files is None
    tokens = tokens_for(model)
    before = model(tokens)
    for path in weight_files(folder):
        overwrite_in_place(path)
    assert torch.equal(model(tokens), before)  # nothing of the file is used after load
    mapped = HookedTransformer.from_pretrained(folder)  # the same files, mapped: the edit shows
    assert not torch.equal(mapped(tokens), before)


def test_copied_weights_are_not_watched(folder):
    half = HookedTransformer.from_pretrained(folder, dtype="bfloat16")  # converted: a copy, nothing mapped
    assert half.weight_files is None
    model = HookedTransformer.from_pretrained(folder)
    twin = copy.deepcopy(model)
    tokens = tokens_for(model)
    before = model(tokens)
    overwrite_in_place(weight_files(folder)[0])
    with pytest.raises(WeightsChangedError):
        model(tokens)
    assert torch.equal(twin(tokens), before)  # the deep copy holds its weights in memory
    half(tokens)


def test_a_file_changed_while_it_is_read_is_refused(source, tmp_path, monkeypatch):
    import lenskit.io.loading as loading

    folder = tmp_path / "m"
    shutil.copytree(source["gpt2"], folder)
    real = loading.read_safetensors

    def read_then_edit(f):
        tensors = real(f)
        overwrite_in_place(f / "model.safetensors")
        return tensors

    monkeypatch.setattr(loading, "read_safetensors", read_then_edit)
    with pytest.raises(WeightsChangedError, match="model.safetensors changed while it was being read"):
        HookedTransformer.from_pretrained(folder)


def test_the_check_costs_microseconds(source):
    model = HookedTransformer.from_pretrained(source["llama"])
    n_files = len(model.weight_files.paths)
    assert n_files > 1
    check = model.weight_files.check
    start = time.perf_counter()
    for _ in range(20_000):
        check()
    per_call = (time.perf_counter() - start) / 20_000
    assert per_call < 200e-6, f"{per_call * 1e6:.1f} us per forward for {n_files} files"


def test_the_docstring_and_the_reliability_page_state_the_hazard():
    doc = HookedTransformer.from_pretrained.__doc__
    assert "SIGBUS" in doc and "mmap=False" in doc and "weights file changed since load" in doc
    page = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text(encoding="utf-8")
    section = " ".join(page.split("## Memory-mapped weights\n")[1].split("\n## ")[0].split())
    assert "SIGBUS" in section and "mmap=False" in section and "weights file changed since load" in section

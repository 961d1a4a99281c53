"""The user's files that tests/test_files_safety.py and tests/test_files_tokenizers.py damage: model folders made once
per module (`base`: a GPT-2 with tokenizer files, a sharded Llama, a tuned lens, a tuned-lens-package folder, a data
folder) and copies of them with a FIFO in place of one file or some files dropped."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_hf_family
from tiny_tokenizer import save_tiny_model

from lenses.tuned import TunedLens
from lenskit import HookedTransformer


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    """Model folders made once: a GPT-2 with tokenizer.json (+ vocab.json, merges.txt), a sharded Llama,
    a tuned lens, a tuned-lens-package folder and a data folder."""
    root = tmp_path_factory.mktemp("files_safety")
    gpt2 = save_tiny_model(root / "gpt2")
    llama = root / "llama"
    make_hf_family("llama").save_pretrained(llama, max_shard_size="20KB")
    assert (llama / "model.safetensors.index.json").exists(), "the Llama fixture should be sharded"
    model = HookedTransformer.from_pretrained(gpt2)
    TunedLens(model).save(root / "lens")
    package = root / "package"
    package.mkdir()
    (package / "config.json").write_text(json.dumps({"d_model": model.cfg.d_model, "num_hidden_layers": model.cfg.n_layers}))
    torch.save({f"{i}.weight": torch.zeros(model.cfg.d_model, model.cfg.d_model) for i in range(model.cfg.n_layers)},
               package / "params.pt")
    data = root / "data"
    data.mkdir()
    (data / "a.py").write_text("def add(a, b):\n    return a + b\n" * 20)
    return {"gpt2": gpt2, "llama": llama, "lens": root / "lens", "package": package, "data": data}


def copy_with(src: Path, dst: Path, fifo: str | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of folder `src` at `dst`, with `fifo` (a file name) replaced by a FIFO and `drop` removed."""
    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    if fifo is not None:
        (dst / fifo).unlink(missing_ok=True)
        os.mkfifo(dst / fifo)
    return dst


def first_shard(folder: Path) -> str:
    return sorted(p.name for p in folder.glob("model-*.safetensors"))[0]

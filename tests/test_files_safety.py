"""A user's files where lenskit reads and writes them (lenskit/io/files.py): FIFOs and devices never block,
JSON is bounded in size and depth, and quantised dtypes are refused by tensor name; every rule on several files,
families or arguments. Failures inside `tokenizers` and unusable devices: tests/test_files_tokenizers.py.

FIFO cases run in a forked child with a deadline (tests/forked.py): a regression hangs inside Rust or C,
where no alarm in this process could stop it, and the child is killed instead.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from forked import run_forked
from safetensors.torch import load_file, save_file
from user_files import base, copy_with, first_shard  # noqa: F401 - base is a fixture

from lenses.tuned import TunedLens
from lenskit import HookedTransformer
from lenskit.io.data import list_files, read_documents
from lenskit.io.files import JSON_MAX_BYTES, NotARegularFileError, check_output_file, open_output, read_json
from lenskit.io.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(os.name != "posix", reason="FIFOs and fork are POSIX")

DEADLINE = 30.0  # seconds; each case takes well under one (see the FIFO timings in the report)


# ------------------------------------------------------------------------------------------ FIFOs
MODEL_FIFOS = [
    ("gpt2", "config.json"),
    ("gpt2", "model.safetensors"),
    ("gpt2", "tokenizer.json"),
    ("gpt2", "tokenizer_config.json"),
    ("gpt2", "special_tokens_map.json"),  # a file transformers would open if it were there
    ("llama", "config.json"),
    ("llama", "model.safetensors.index.json"),
    ("llama", "<first shard>"),
]


@pytest.mark.parametrize("family, name", MODEL_FIFOS, ids=[f"{f}-{n}" for f, n in MODEL_FIFOS])
def test_a_fifo_in_a_model_folder_is_refused_at_once(base, tmp_path, family, name):
    name = first_shard(base[family]) if name == "<first shard>" else name
    folder = copy_with(base[family], tmp_path / "m", fifo=name)
    outcome = run_forked(lambda: HookedTransformer.from_pretrained(folder), DEADLINE)
    outcome.raised("NotARegularFileError", name, "is not a regular file", "FIFO")
    assert outcome.seconds < DEADLINE


@pytest.mark.parametrize("name, drop", [("vocab.json", ("tokenizer.json",)), ("merges.txt", ("tokenizer.json",))])
def test_a_fifo_among_gpt2_bpe_files_is_refused(base, tmp_path, name, drop):
    folder = copy_with(base["gpt2"], tmp_path / "m", fifo=name, drop=drop)
    run_forked(lambda: load_tokenizer(folder), DEADLINE).raised("NotARegularFileError", name, "is not a regular file")


@pytest.mark.parametrize("kind, name", [("lens", "config.json"), ("package", "config.json"), ("package", "params.pt")])
def test_a_fifo_in_a_lens_folder_is_refused(base, tmp_path, kind, name):
    folder = copy_with(base[kind], tmp_path / "lens", fifo=name)
    gpt2 = base["gpt2"]
    outcome = run_forked(lambda: TunedLens.load(folder, HookedTransformer.from_pretrained(gpt2)), DEADLINE)
    outcome.raised("NotARegularFileError", name, "is not a regular file")


def test_a_fifo_as_data_says_what_it_is_not_that_it_is_missing(base, tmp_path):
    fifo = tmp_path / "data.txt"
    os.mkfifo(fifo)
    outcome = run_forked(lambda: read_documents([fifo]), DEADLINE).raised("NotARegularFileError", "data.txt",
                                                                         "not a regular file", "FIFO")
    assert "does not exist" not in outcome.message
    # Inside a folder, too: a FIFO with a text suffix is refused by name, not skipped or read.
    folder = copy_with(base["data"], tmp_path / "folder")
    os.mkfifo(folder / "b.txt")
    run_forked(lambda: list_files([folder]), DEADLINE).raised("NotARegularFileError", "b.txt", "not a regular file")
    run_forked(lambda: read_documents([folder]), DEADLINE).raised("NotARegularFileError", "b.txt")


def test_cli_data_fifo_is_one_line_exit_2(base, tmp_path):
    import contextlib
    import io

    from lenses.cli import main

    fifo = tmp_path / "held_out.txt"
    os.mkfifo(fifo)

    def run():
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["eval-lens", "--model", str(base["gpt2"]), "--lens", str(base["lens"]), "--data", str(fifo),
                       "--ctx", "16", "--quiet"])
        return rc, err.getvalue()

    outcome = run_forked(run, DEADLINE)
    assert outcome.kind == "returned", outcome
    rc, stderr = outcome.value
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, stderr
    assert "held_out.txt" in lines[0] and "not a regular file" in lines[0] and "does not exist" not in lines[0], lines


def test_writers_refuse_non_regular_outputs_before_work(tmp_path):
    fifo = tmp_path / "out.png"
    os.mkfifo(fifo)
    with pytest.raises(NotARegularFileError, match="out.png.*not a regular file.*FIFO"):
        check_output_file(fifo, "the --out figure")
    with pytest.raises(IsADirectoryError, match="is a folder"):
        check_output_file(tmp_path, "the --out figure")
    assert check_output_file(tmp_path / "new.csv") == tmp_path / "new.csv"
    if os.path.exists("/dev/null"):
        assert check_output_file("/dev/null", "a CSV table", pipe_ok=True)  # a stream sink is fine for a table
        with pytest.raises(NotARegularFileError, match="character device"):
            check_output_file("/dev/null", "a figure")


def test_open_output_refuses_a_fifo_nobody_reads_and_writes_to_one_that_is_read(tmp_path):
    fifo = tmp_path / "table.csv"
    os.mkfifo(fifo)

    def write():
        with open_output(fifo, "the --csv table", pipe_ok=True) as f:
            f.write("layer,kl\n0,1.5\n")

    run_forked(write, DEADLINE).raised("OSError", "table.csv", "no process is reading")
    run_forked(lambda: open_output(fifo, "a figure").__enter__(), DEADLINE).raised("NotARegularFileError", "table.csv")
    # With a reader on the other end, writing to the pipe is the point (`--csv /dev/stdout`, `--csv >(sort)`).
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # this process reads: the writer's open succeeds
    try:
        outcome = run_forked(write, DEADLINE)
        assert outcome.kind == "returned", outcome
        assert os.read(reader, 1 << 16) == b"layer,kl\n0,1.5\n"
    finally:
        os.close(reader)


def test_save_pretrained_into_a_folder_holding_a_fifo_is_refused(base, tmp_path):
    folder = copy_with(base["gpt2"], tmp_path / "m", fifo="tokenizer.json")
    model = HookedTransformer.from_pretrained(base["gpt2"])
    run_forked(lambda: model.save_pretrained(folder), DEADLINE).raised("NotARegularFileError", "tokenizer.json")


# ------------------------------------------------------------------------------------------ JSON bounds
def json_in_folder(name: str, folder_of: str, load, *, drop: tuple[str, ...] = ()):
    """A writer for the JSON bound tests: `raw` as file `name` in a copy of base[folder_of] (less `drop`), and the
    call that reads it, `load(folder)`."""
    def write(base, tmp_path, raw: bytes):
        folder = copy_with(base[folder_of], tmp_path / "m", drop=drop)
        (folder / name).write_bytes(raw)
        return lambda: load(folder), name
    write.__name__ = f"write_{name.removesuffix('.json').replace('.', '_')}"
    return write


def write_lens_config(base, tmp_path, raw: bytes):
    folder = copy_with(base["lens"], tmp_path / "lens")
    (folder / "config.json").write_bytes(raw)
    model = HookedTransformer.from_pretrained(base["gpt2"])
    return lambda: TunedLens.load(folder, model), "config.json"


write_model_config = json_in_folder("config.json", "gpt2", HookedTransformer.from_pretrained)
write_model_config.__name__ = "write_model_config"
JSON_FILES = [write_model_config, write_lens_config,
              json_in_folder("tokenizer_config.json", "gpt2", load_tokenizer),
              json_in_folder("model.safetensors.index.json", "llama", HookedTransformer.from_pretrained),
              json_in_folder("vocab.json", "gpt2", load_tokenizer, drop=("tokenizer.json",)),
              json_in_folder("tokenizer.json", "gpt2", load_tokenizer),
              json_in_folder("special_tokens_map.json", "gpt2", load_tokenizer)]


@pytest.mark.parametrize("write", JSON_FILES, ids=[w.__name__.removeprefix("write_") for w in JSON_FILES])
def test_json_nested_100000_deep_is_one_line_fast(base, tmp_path, write):
    run, name = write(base, tmp_path, b"[" * 100_000 + b"]" * 100_000)
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        run()
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert name in message and "nests" in message and "\n" not in message, message


@pytest.mark.parametrize("write", JSON_FILES[:3], ids=[w.__name__.removeprefix("write_") for w in JSON_FILES[:3]])
def test_json_deeper_than_the_bound_but_parseable_is_refused(base, tmp_path, write):
    run, name = write(base, tmp_path, json.dumps({"model_type": "gpt2", "x": json.loads("[" * 200 + "]" * 200)}).encode())
    with pytest.raises(ValueError, match=rf"{name}.*nests JSON 201 levels deep, more than the 64"):
        run()


@pytest.mark.parametrize("write", JSON_FILES, ids=[w.__name__.removeprefix("write_") for w in JSON_FILES])
def test_json_that_is_not_utf8_names_the_file(base, tmp_path, write):
    run, name = write(base, tmp_path, b'{"model_type": "gpt2", "name": "caf\xe9\xff"}')
    with pytest.raises(ValueError) as info:
        run()
    message = str(info.value)
    assert name in message and "not UTF-8" in message and "\n" not in message, message


@pytest.mark.parametrize("write", [write_model_config, write_lens_config], ids=["model_config", "lens_config"])
def test_json_larger_than_the_bound_is_refused_before_it_is_read(base, tmp_path, write):
    run, name = write(base, tmp_path, b"{}")
    target = next(p for p in tmp_path.rglob(name))
    with open(target, "r+b") as f:
        f.truncate(JSON_MAX_BYTES + 1)  # sparse: no disk, no time
    with pytest.raises(ValueError, match=rf"{name} is {JSON_MAX_BYTES + 1:,} bytes, more than the {JSON_MAX_BYTES:,}"):
        run()


def test_read_json_bounds_are_arguments(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"a": {"b": {"c": 1}}}))
    assert read_json(path)["a"]["b"]["c"] == 1
    with pytest.raises(ValueError, match="nests JSON 3 levels deep, more than the 2"):
        read_json(path, max_depth=2)
    with pytest.raises(ValueError, match="more than the 10"):
        read_json(path, max_bytes=10)
    path.write_text('{"n": ' + "9" * 5000 + "}")  # more digits than Python converts to an int
    with pytest.raises(ValueError, match="x.json holds a value that cannot be read"):
        read_json(path)


# ------------------------------------------------------------------------------------------ dtypes
def recast(folder: Path, edit) -> None:
    """Rewrite every safetensors file of `folder` with `edit(name, tensor)` -> {name: tensor} applied."""
    for file in folder.glob("*.safetensors"):
        tensors = {}
        for name, tensor in load_file(file).items():
            tensors.update(edit(name, tensor))
        save_file(tensors, file, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():  # names may have changed: rebuild the weight map
        weight_map = {k: f.name for f in folder.glob("*.safetensors") for k in load_file(f)}
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def cast_one(target: str, dtype: torch.dtype):
    def edit(name, tensor):
        if not name.endswith(target):
            return {name: tensor}
        if dtype == torch.float4_e2m1fn_x2:  # packed two to a byte
            return {name: tensor.flatten()[: tensor.numel() // 2].to(torch.uint8).view(dtype)}
        return {name: tensor.to(dtype)}
    return edit


def packed_int4(target: str):
    def edit(name, tensor):  # as bitsandbytes stores 4-bit weights: uint8 [numel / 2, 1]
        return {name: torch.zeros(tensor.numel() // 2, 1, dtype=torch.uint8)} if name.endswith(target) else {name: tensor}
    return edit


def gptq(target: str):
    def edit(name, tensor):  # GPTQ: the weight becomes int32 qweight + scales + qzeros
        if not name.endswith(target + ".weight"):
            return {name: tensor}
        stem = name.removesuffix(".weight")
        return {f"{stem}.qweight": torch.zeros(tensor.shape[1] // 8, tensor.shape[0], dtype=torch.int32),
                f"{stem}.scales": torch.ones(1, tensor.shape[0], dtype=torch.float16)}
    return edit


DTYPE_CASES = [
    ("gpt2", cast_one("h.0.attn.c_attn.weight", torch.float8_e4m3fn), "h.0.attn.c_attn.weight", "float8_e4m3fn"),
    ("gpt2", cast_one("h.1.mlp.c_fc.weight", torch.float4_e2m1fn_x2), "h.1.mlp.c_fc.weight", "float4_e2m1fn_x2"),
    ("llama", cast_one("layers.0.mlp.up_proj.weight", torch.float8_e5m2), "layers.0.mlp.up_proj.weight", "float8_e5m2"),
    ("llama", packed_int4("layers.1.self_attn.q_proj.weight"), "layers.1.self_attn.q_proj.weight", "uint8"),
    ("llama", gptq("layers.0.mlp.down_proj"), "layers.0.mlp.down_proj.qweight", "int32"),
]


@pytest.mark.parametrize("family, edit, tensor, dtype", DTYPE_CASES, ids=[f"{c[0]}-{c[3]}" for c in DTYPE_CASES])
def test_a_dtype_lenskit_does_not_compute_in_is_refused_by_tensor_name(base, tmp_path, family, edit, tensor, dtype):
    folder = copy_with(base[family], tmp_path / "m")
    recast(folder, edit)
    with pytest.raises(ValueError) as info:  # not the NotImplementedError of isfinite on float8
        HookedTransformer.from_pretrained(folder)
    message = str(info.value)
    assert tensor in message and dtype in message and "dequantise" in message and "\n" not in message, message


def test_float64_checkpoint_still_loads(base, tmp_path):
    folder = copy_with(base["gpt2"], tmp_path / "m")
    recast(folder, lambda name, t: {name: t.double() if t.is_floating_point() else t})
    model = HookedTransformer.from_pretrained(folder)
    assert model.embed.weight.dtype == torch.float32

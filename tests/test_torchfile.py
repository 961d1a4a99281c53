"""`.pt` files from elsewhere (lenskit/io/torchfile.py): only uncompressed zip entries whose sizes match the
storages the pickle declares are read, so a zip bomb is refused before it is inflated; a pickled object is
refused without running anything; a normal torch.save file loads as torch.load loads it."""

from __future__ import annotations

import collections
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from lenses.tuned import TunedLens
from lenskit.io.files import NotARegularFileError
from lenskit.io.torchfile import TorchFileError, read_plain_torch_file

ROOT = Path(__file__).resolve().parents[1]
GB = 1 << 30


# ------------------------------------------------------------------------------------------ building files
class _Storage:
    """Stands for a tensor storage in a hand-written torch.save pickle."""

    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Tensor:
    def __init__(self, storage: _Storage, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        stride = tuple(int(torch.tensor(self.shape[i + 1:]).prod()) for i in range(len(self.shape)))
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, self.shape, stride, False, collections.OrderedDict())


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


def torch_pickle(state: dict) -> bytes:
    """The data.pkl torch.save would write for `state` (name -> _Tensor), without allocating the tensors."""
    import io

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(state)
    return buf.getvalue()


def write_zip(path: Path, entries: list[tuple[str, int, bytes, int, int]], aliases: dict[str, str] | None = None) -> None:
    """A zip written by hand: (name, method, stored bytes, crc32, uncompressed size) per entry; `aliases` adds
    central-directory entries that point at another entry's local header (overlapping entries)."""
    out, central, offsets = bytearray(), bytearray(), {}
    for name, method, data, crc, size in entries:
        offsets[name] = len(out)
        n = name.encode()
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0, crc, len(data), size, len(n), 0) + n + data
    rows = [(name, name, m, d, c, s) for name, m, d, c, s in entries]
    for alias, target in (aliases or {}).items():
        _, m, d, c, s = next(e for e in entries if e[0] == target)
        rows.append((alias, target, m, d, c, s))
    for name, target, method, data, crc, size in rows:
        n = name.encode()
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0, crc, len(data), size, len(n),
                               0, 0, 0, 0, 0, offsets[target]) + n
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(rows), len(rows), len(central), len(out), 0)
    path.write_bytes(bytes(out + central + eocd))


def deflated_zeros(size: int) -> bytes:
    """A raw DEFLATE stream of `size` zero bytes, made from one compressed 1 MiB block repeated (a full flush
    makes every block alike), so a 1 GB claim costs milliseconds to build."""
    chunk = bytes(1 << 20)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    return first + block * (size // len(chunk) - 1) + c.flush(zlib.Z_FINISH)


def bomb(path: Path, claim: int = GB, key: str = "0.weight") -> Path:
    """A tuned-lens params.pt of about 1 MB whose one tensor, DEFLATE-compressed, inflates to `claim` bytes."""
    pkl = torch_pickle({key: _Tensor(_Storage("0", claim // 4), (claim // 4,))})
    data, crc = deflated_zeros(claim), 0  # the crc32 is checked only after inflating, which is what must not happen
    write_zip(path, [("archive/data.pkl", 0, pkl, zlib.crc32(pkl), len(pkl)),
                     ("archive/byteorder", 0, b"little", zlib.crc32(b"little"), 6),
                     ("archive/data/0", zipfile.ZIP_DEFLATED, data, crc, claim),
                     ("archive/version", 0, b"3\n", zlib.crc32(b"3\n"), 2)])
    return path


def stored(path: Path, state: dict, records: dict[str, bytes], aliases: dict[str, str] | None = None) -> Path:
    """A STORED torch.save-like zip from a hand-written pickle and records."""
    pkl = torch_pickle(state)
    entries = [("archive/data.pkl", 0, pkl, zlib.crc32(pkl), len(pkl)), ("archive/byteorder", 0, b"little", zlib.crc32(b"little"), 6)]
    entries += [(f"archive/data/{k}", 0, v, zlib.crc32(v), len(v)) for k, v in records.items()]
    entries += [("archive/version", 0, b"3\n", zlib.crc32(b"3\n"), 2)]
    write_zip(path, entries, aliases)
    return path


# ------------------------------------------------------------------------------------------ what loads
def test_a_torch_save_file_loads_as_torch_load_loads_it(tmp_path):
    weight = torch.randn(6, 6)
    state = {"0.weight": weight, "0.bias": torch.zeros(6), "row": weight[2], "ids": torch.arange(5),
             "half": torch.randn(3).half(), "f8": torch.zeros(2, dtype=torch.float8_e4m3fn),
             "meta": {"n_prompts": 12, "source_layers": [0, 1, 2], "note": "reference", "scale": 1.5, "none": None}}
    torch.save(state, tmp_path / "ref.pt")
    got = read_plain_torch_file(tmp_path / "ref.pt")
    want = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert got.keys() == want.keys() and got["meta"] == state["meta"]
    for k in ("0.weight", "0.bias", "row", "ids", "half"):
        assert torch.equal(got[k], state[k]) and got[k].dtype == state[k].dtype
    assert got["row"].untyped_storage().data_ptr() == got["0.weight"].untyped_storage().data_ptr()  # views stay views
    torch.save(torch.nn.Linear(4, 4).state_dict(), tmp_path / "linear.pt")
    assert set(read_plain_torch_file(tmp_path / "linear.pt")) == {"weight", "bias"}
    torch.save(torch.ones(3), tmp_path / "tensor.pt")
    assert torch.equal(read_plain_torch_file(tmp_path / "tensor.pt"), torch.ones(3))


def test_a_hand_written_stored_file_of_the_right_sizes_loads(tmp_path):
    values = torch.arange(6, dtype=torch.float32)
    path = stored(tmp_path / "ok.pt", {"w": _Tensor(_Storage("0", 6), (2, 3))}, {"0": values.numpy().tobytes()})
    assert torch.equal(read_plain_torch_file(path)["w"], values.view(2, 3))


# ------------------------------------------------------------------------------------------ what is refused
@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux")
def test_a_one_megabyte_deflate_bomb_claiming_one_gigabyte_is_refused_in_tiny_memory(tmp_path):
    path = bomb(tmp_path / "params.pt")
    assert os.path.getsize(path) < 2 << 20
    assert zipfile.ZipFile(path).getinfo("archive/data/0").file_size == GB  # it claims 1 GB
    ok = tmp_path / "ok.pt"
    torch.save({"0.weight": torch.zeros(8)}, ok)
    # One fresh interpreter: the peak after everything is imported and a normal file read, then after the bomb.
    probe = f"""
import resource
from lenskit.io.torchfile import TorchFileError, read_plain_torch_file
read_plain_torch_file({str(ok)!r})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    read_plain_torch_file({str(path)!r})
except TorchFileError as e:
    print("REFUSED", e)
print("GROWTH_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "BASE_KB", before)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "REFUSED" in out and "DEFLATE" in out and "1,073,741,824" in out, out
    growth_mb = int(out.split("GROWTH_KB")[1].split()[0]) / 1024
    assert growth_mb < 16, f"refusing the bomb raised the peak by {growth_mb:.0f} MB"


def test_the_tuned_lens_import_refuses_the_bomb(tmp_path, model):
    folder = tmp_path / "lens"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"d_model": model.cfg.d_model, "num_hidden_layers": model.cfg.n_layers}))
    bomb(folder / "params.pt", claim=64 << 20)
    with pytest.raises(ValueError, match=r"params.pt is not a plain torch.save file: entry archive/data/0 is DEFLATE-compressed"):
        TunedLens.load(folder, model)


@pytest.fixture(scope="module")
def model():
    from conftest import make_hf_gpt2

    from lenskit import HookedTransformer

    return HookedTransformer.from_hf(make_hf_gpt2(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=32))


def test_any_compressed_entry_is_refused_even_a_small_one(tmp_path):
    torch.save({"w": torch.zeros(64)}, tmp_path / "plain.pt")
    src = zipfile.ZipFile(tmp_path / "plain.pt")
    with zipfile.ZipFile(tmp_path / "deflated.pt", "w", compression=zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            out.writestr(info.filename, src.read(info))
    assert torch.equal(torch.load(tmp_path / "deflated.pt", weights_only=True)["w"], torch.zeros(64))  # torch would read it
    with pytest.raises(TorchFileError, match="DEFLATE-compressed"):
        read_plain_torch_file(tmp_path / "deflated.pt")


@pytest.mark.parametrize("case, words", [
    ("record shorter than declared", ("holds 8 bytes", "declares a storage of 24")),
    ("record longer than declared", ("holds 400 bytes", "declares a storage of 24")),
    ("no record", ("no data/0 entry",)),
    ("an extra record", ("data/1 is not a storage the pickle declares",)),
    ("overlapping entries", ("overlap",)),
])
def test_records_must_match_the_storages_the_pickle_declares(tmp_path, case, words):
    state = {"w": _Tensor(_Storage("0", 6), (6,))}
    records = {"record shorter than declared": {"0": bytes(8)}, "record longer than declared": {"0": bytes(400)},
               "no record": {}, "an extra record": {"0": bytes(24), "1": bytes(4)},
               "overlapping entries": {"0": bytes(24)}}[case]
    aliases = {f"archive/copy{i}": "archive/data/0" for i in range(200)} if case == "overlapping entries" else None
    path = stored(tmp_path / "x.pt", state, records, aliases)
    with pytest.raises(TorchFileError) as info:
        read_plain_torch_file(path)
    message = str(info.value)
    assert all(w in message for w in words) and "x.pt" in message and "\n" not in message, message


class RunsCode:
    """Unpickling this would create a file: proof that something ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.mark.parametrize("where", ["a value", "the whole file"])
def test_a_pickled_object_is_refused_and_nothing_runs(tmp_path, where):
    marker = tmp_path / "ran"
    payload = RunsCode(marker)
    torch.save({"0.weight": torch.zeros(2), "x": payload} if where == "a value" else payload, tmp_path / "evil.pt")
    with pytest.raises(TorchFileError, match="evil.pt is not a plain tensor file.*nothing in it was executed"):
        read_plain_torch_file(tmp_path / "evil.pt")
    assert not marker.exists()


@pytest.mark.parametrize("content, words", [
    (None, ("legacy pre-1.6",)),
    (b"not a zip at all", ("not a zip-format torch.save file",)),
    (b"", ("not a zip-format",)),
])
def test_files_that_are_not_zip_torch_files_are_refused(tmp_path, content, words):
    path = tmp_path / "old.pt"
    if content is None:
        torch.save({"a": torch.zeros(2)}, path, _use_new_zipfile_serialization=False)
    else:
        path.write_bytes(content)
    with pytest.raises(TorchFileError) as info:
        read_plain_torch_file(path)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.skipif(os.name != "posix", reason="FIFOs are POSIX")
def test_a_fifo_or_a_missing_file_is_one_line(tmp_path):
    from forked import run_forked

    os.mkfifo(tmp_path / "params.pt")
    run_forked(lambda: read_plain_torch_file(tmp_path / "params.pt"), 30).raised("NotARegularFileError", "params.pt")
    with pytest.raises(FileNotFoundError, match="nowhere.pt does not exist"):
        read_plain_torch_file(tmp_path / "nowhere.pt")
    assert issubclass(NotARegularFileError, OSError)

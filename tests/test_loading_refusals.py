"""from_pretrained refuses bad checkpoints by name and loses nothing: pickle-only folders (never unpickled), checkpoints
whose keys or shapes do not match, corrupt safetensors and shard indexes, missing paths, other model types, bad
tokens, non-finite or integer weights, bad dtypes; and a checkpoint already in the asked dtype is not copied."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from gpt2_layouts import layout_bare_tied, layout_sharded, tiny_gpt2, write_config
from safetensors.torch import load_file, save_file

from lenskit import CheckpointError, HookedTransformer


@pytest.fixture(scope="module")
def hf():
    return tiny_gpt2()


# ---------------------------------------------------------------- bad input
@pytest.fixture
def no_pickle(monkeypatch):
    """Make every way of unpickling fail loudly and record any attempt."""
    attempts: list[str] = []

    def banned(what):
        def fail(*args, **kwargs):
            attempts.append(what)
            raise AssertionError(f"{what} was called: lenskit must never unpickle")
        return fail

    monkeypatch.setattr(torch, "load", banned("torch.load"))
    monkeypatch.setattr(pickle, "load", banned("pickle.load"))
    monkeypatch.setattr(pickle, "loads", banned("pickle.loads"))
    monkeypatch.setattr(pickle, "Unpickler", banned("pickle.Unpickler"))
    return attempts


@pytest.fixture(scope="module")
def good_model(hf):
    return HookedTransformer.from_hf(hf)


@pytest.fixture
def still_usable(good_model):
    """Checks after the test that the model gives the same logits as before it."""
    tokens = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        before = good_model(tokens)
    yield good_model
    with torch.no_grad():
        assert torch.equal(good_model(tokens), before)
    assert not any(hp.has_hooks() for hp in good_model.hook_dict.values())


def test_pickle_only_folder_is_refused_without_unpickling(hf, tmp_path, no_pickle):
    folder = tmp_path / "pickled"
    write_config(hf, folder)
    with open(folder / "pytorch_model.bin", "wb") as f:  # writing a pickle is harmless; reading one is not
        pickle.dump({"wte.weight": [0.0]}, f)
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*refuses to unpickle"):
        HookedTransformer.from_pretrained(folder)
    assert no_pickle == []


def _edited(hf, folder: Path, edit) -> Path:
    layout_bare_tied(hf, folder)
    state = load_file(str(folder / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.__setitem__("h.0.mlp.c_fc.bias", torch.zeros(7)), r"'h\.0\.mlp\.c_fc\.bias' has shape \(7,\)"),
        (lambda s: s.__setitem__("h.2.attn.c_attn.weight", torch.zeros(96, 32)), r"h\.2\.attn\.c_attn\.weight.*\(32, 96\)"),
        (lambda s: s.pop("h.1.ln_2.weight"), r"missing.*h\.1\.ln_2\.weight"),
        (lambda s: s.pop("wpe.weight"), r"missing.*wpe\.weight"),
        (lambda s: s.__setitem__("h.0.attn.rotary", torch.zeros(3)), r"h\.0\.attn\.rotary"),
        (lambda s: s.__setitem__("h.3.ln_1.weight", torch.ones(32)), r"h\.3\.ln_1\.weight"),
        (lambda s: s.__setitem__("lm_head.weight", torch.zeros(101, 32)), "lm_head.weight differs"),
    ],
    ids=["shape-bias", "shape-conv1d", "missing-block", "missing-top", "extra", "extra-layer", "untied-lm-head"],
)
def test_mismatched_checkpoints_name_the_key(hf, tmp_path, edit, match, no_pickle, still_usable):
    folder = _edited(hf, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=match):
        HookedTransformer.from_pretrained(folder)
    assert no_pickle == []


def test_prefixed_and_bare_duplicate_keys_are_refused(hf, tmp_path):
    folder = _edited(hf, tmp_path / "dup", lambda s: s.__setitem__("transformer.wte.weight", s["wte.weight"].clone()))
    with pytest.raises(CheckpointError, match="wte.weight"):
        HookedTransformer.from_pretrained(folder)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "pickle-renamed"])
def test_corrupt_safetensors(hf, tmp_path, damage, no_pickle, still_usable):
    folder = layout_bare_tied(hf, tmp_path / damage)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    if damage == "truncated":
        file.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        file.write_bytes(bytes(range(256)) * 64)
    elif damage == "empty":
        file.write_bytes(b"")
    else:  # a pickle under the safetensors name must be rejected by the header check, never unpickled
        file.write_bytes(pickle.dumps({"wte.weight": list(range(100))}))
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        HookedTransformer.from_pretrained(folder)
    assert no_pickle == []


@pytest.mark.parametrize(
    "shard, match",
    [("../x.safetensors", "same folder"), ("/etc/passwd", "same folder"), ("model.bin", "same folder"),
     ("missing.safetensors", "does not exist")],
)
def test_bad_shard_index(hf, tmp_path, shard, match, no_pickle):
    folder = layout_sharded(hf, tmp_path / "sharded")
    (tmp_path / "x.safetensors").write_bytes((folder / "model-00001-of-00003.safetensors").read_bytes())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=match):
        HookedTransformer.from_pretrained(folder)
    assert no_pickle == []


def test_malformed_index_and_missing_listed_tensor(hf, tmp_path):
    folder = layout_sharded(hf, tmp_path / "s")
    index_file = folder / "model.safetensors.index.json"
    good = json.loads(index_file.read_text())
    index_file.write_text("{}")
    with pytest.raises(CheckpointError, match="weight_map"):
        HookedTransformer.from_pretrained(folder)
    good["weight_map"]["h.9.ghost.weight"] = "model-00001-of-00003.safetensors"
    index_file.write_text(json.dumps(good))
    with pytest.raises(CheckpointError, match=r"h\.9\.ghost\.weight"):
        HookedTransformer.from_pretrained(folder)


def test_missing_paths(tmp_path, hf):
    with pytest.raises(FileNotFoundError, match="no folder at"):
        HookedTransformer.from_pretrained(tmp_path / "does" / "not" / "exist")
    (tmp_path / "file.safetensors").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        HookedTransformer.from_pretrained(tmp_path / "file.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        HookedTransformer.from_pretrained(empty)
    write_config(hf, empty)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        HookedTransformer.from_pretrained(empty)


def test_non_gpt2_config_is_refused(hf, tmp_path):
    folder = layout_bare_tied(hf, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["activation_function"] = "silu"  # relu is built since the ReLU MLP (issue 37)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="activation_function"):
        HookedTransformer.from_pretrained(folder)


@pytest.mark.parametrize(
    "tokens, error, match",
    [
        (torch.tensor([[1, 2, 101]]), ValueError, r"token id 101 at \[batch 0, pos 2\] is outside the vocabulary"),
        (torch.tensor([[1, -1]]), ValueError, "outside the vocabulary"),
        (torch.tensor([[1.0, 2.0]]), TypeError, "integer tensor"),
        (torch.tensor([[True, False]]), TypeError, "integer tensor"),
        (torch.zeros(1, 65, dtype=torch.long), ValueError, "n_ctx=64"),
        (torch.zeros(1, 0, dtype=torch.long), ValueError, "pos >= 1"),
        (torch.zeros(2, 3, 4, dtype=torch.long), ValueError, r"\[batch, pos\]"),
        ([1, 2, 3], TypeError, "LongTensor"),
        ("some text", ValueError, "no tokenizer"),
    ],
    ids=["too-big", "negative", "float", "bool", "too-long", "empty", "3d", "list", "text-without-tokenizer"],
)
def test_bad_tokens_get_clear_errors(still_usable, tokens, error, match):
    model = still_usable
    with pytest.raises(error, match=match):
        model(tokens)
    with pytest.raises(error, match=match):
        model.run_with_cache(tokens)


def test_generate_slides_the_window_past_n_ctx(good_model):
    prompt = torch.randint(0, 101, (1, 62), generator=torch.Generator().manual_seed(0))
    out = good_model.generate(prompt, max_new_tokens=4)
    assert out.shape == (1, 66) and torch.equal(out[:, :62], prompt)
    with torch.no_grad():  # the last new token is predicted from the last n_ctx tokens only
        assert out[0, -1] == good_model(out[:, -65:-1])[0, -1].argmax()


# ---------------------------------------------------------------- values, dtypes, speed of refusal
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("bad", ["nan", "inf", "int"])
def test_nan_inf_and_integer_weights_are_refused_by_name(family, bad, tmp_path):
    from conftest import make_hf_family

    folder = tmp_path / "m"
    make_hf_family(family).save_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    key = next(k for k in state if k.endswith("mlp.c_fc.weight" if family == "gpt2" else "mlp.up_proj.weight"))
    t = state[key]
    if bad == "int":
        state[key] = t.to(torch.int8)
    else:
        t = t.clone()
        t[0, 0] = float(bad)
        state[key] = t
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    match = "floating point" if bad == "int" else "NaN or inf"
    with pytest.raises(CheckpointError, match=rf"{re.escape(key.split('.', 1)[1])}.*{match}"):
        HookedTransformer.from_pretrained(folder)


def test_many_layers_with_missing_tensors_fail_fast(hf, tmp_path):
    """A config claiming 3000 layers over a 3-layer checkpoint: one line saying how many blocks are missing, quickly
    (the claim is checked against the tensor names before anything is built per layer; tests/test_config_defaults.py
    runs 10**9)."""
    import time

    folder = layout_bare_tied(hf, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["n_layer"] = 3000
    (folder / "config.json").write_text(json.dumps(cfg))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"n_layer=3000 does not match the checkpoint, whose tensor names hold 3 "
                                         r"block\(s\): 2997 are missing"):
        HookedTransformer.from_pretrained(folder)
    assert time.perf_counter() - start < 5  # checked before a 3000-block model is built; no quadratic sort


@pytest.mark.parametrize("dtype, want", [("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32),
                                         ("torch.bfloat16", torch.bfloat16), (None, torch.float32), (torch.float64, torch.float64)])
def test_dtype_names_are_accepted(hf, tmp_path, dtype, want):
    folder = layout_bare_tied(hf, tmp_path / "m")
    assert HookedTransformer.from_pretrained(folder, dtype=dtype).embed.weight.dtype == want


@pytest.mark.parametrize("dtype", ["bf61", "int8", torch.int64, 3])  # "bf16" is a spelling lenskit takes (test_devices)
def test_bad_dtype_is_refused(hf, tmp_path, dtype):
    folder = layout_bare_tied(hf, tmp_path / "m")
    with pytest.raises(ValueError, match=r"dtype=.*not a.*dtype.*bfloat16"):
        HookedTransformer.from_pretrained(folder, dtype=dtype)


def test_same_dtype_checkpoint_is_assigned_without_a_copy(tmp_path, monkeypatch):
    """Weights already in the asked dtype are the tensors read from the file (memory-mapped), not copies;
    another dtype converts once."""
    from conftest import make_hf_family

    import lenskit.io.loading

    folder = tmp_path / "m"
    make_hf_family("llama", tie_word_embeddings=False).save_pretrained(folder)
    read = {}
    real = lenskit.io.loading.read_safetensors
    monkeypatch.setattr(lenskit.io.loading, "read_safetensors", lambda f: read.update(real(f)) or read)
    model = HookedTransformer.from_pretrained(folder)
    stored = read["model.layers.0.mlp.up_proj.weight"]
    assert model.blocks[0].mlp.fc_in.weight.data_ptr() == stored.data_ptr()
    assert model.unembed.weight.data_ptr() == read["lm_head.weight"].data_ptr()
    half = HookedTransformer.from_pretrained(folder, dtype="bfloat16")
    assert half.blocks[0].mlp.fc_in.weight.data_ptr() != read["model.layers.0.mlp.up_proj.weight"].data_ptr()

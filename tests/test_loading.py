"""from_pretrained on every HF GPT-2 layout found in the wild, saving, hub names, and bad input.

Every layout is checked for golden parity against the transformers model that wrote it.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from conftest import make_hf_gpt2
from golden import ATOL, assert_golden, max_diff
from lenskit import CheckpointError, HookedTransformer


@pytest.fixture(scope="module")
def hf():
    return make_hf_gpt2(n_layer=3, n_embd=32, n_head=4, vocab_size=101, n_positions=64, seed=11)


@pytest.fixture(scope="module")
def hf_untied():
    return make_hf_gpt2(n_layer=2, n_embd=24, n_head=3, vocab_size=71, n_positions=32, seed=12,
                        tie_word_embeddings=False)


@pytest.fixture
def batch():
    return torch.randint(0, 71, (2, 15), generator=torch.Generator().manual_seed(2))


def write_config(hf_model, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    hf_model.config.to_json_file(str(folder / "config.json"))


def bare_state(hf_model) -> dict[str, torch.Tensor]:
    """GPT2Model's own keys (no `transformer.` prefix), contiguous copies ready for save_file."""
    return {k: v.detach().clone().contiguous() for k, v in hf_model.transformer.state_dict().items()
            if not re.fullmatch(r"h\.\d+\.attn\.(bias|masked_bias)", k)}  # layout (3) adds these on purpose


def layout_prefixed_with_lm_head(hf_model, folder: Path) -> Path:
    """(1) What GPT2LMHeadModel.save_pretrained writes, with `lm_head.weight` stored even when tied."""
    hf_model.save_pretrained(str(folder))
    state = load_file(str(folder / "model.safetensors"))
    assert all(k.startswith(("transformer.", "lm_head.")) for k in state)
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["transformer.wte.weight"].clone()
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def layout_bare_tied(hf_model, folder: Path) -> Path:
    """(2) GPT2Model keys without prefix and no lm_head (the original openai-community/gpt2 file)."""
    write_config(hf_model, folder)
    state = bare_state(hf_model)
    assert not any(k.startswith("transformer.") or "lm_head" in k for k in state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def layout_mask_buffers(hf_model, folder: Path) -> Path:
    """(3) Old checkpoints that saved the causal-mask buffers `h.{i}.attn.bias` / `attn.masked_bias`."""
    write_config(hf_model, folder)
    state = bare_state(hf_model)
    n = hf_model.config.n_positions
    for i in range(hf_model.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.ones(n, n, dtype=torch.uint8).tril().view(1, 1, n, n)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def layout_sharded(hf_model, folder: Path, n_shards: int = 3) -> Path:
    """(4) Tensors split over several files plus `model.safetensors.index.json`."""
    write_config(hf_model, folder)
    state = {f"transformer.{k}": v for k, v in bare_state(hf_model).items()}
    if not hf_model.config.tie_word_embeddings:
        state["lm_head.weight"] = hf_model.lm_head.weight.detach().clone()
    keys = sorted(state)
    weight_map = {}
    for s in range(n_shards):
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: state[k] for k in keys[s::n_shards]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


LAYOUTS = {
    "prefixed+lm_head": layout_prefixed_with_lm_head,
    "bare-tied": layout_bare_tied,
    "mask-buffers": layout_mask_buffers,
    "sharded": layout_sharded,
}


# -------------------------------------------------------------- golden parity
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_loads_with_golden_parity(hf, tmp_path, layout, batch):
    folder = LAYOUTS[layout](hf, tmp_path / layout)
    model = HookedTransformer.from_pretrained(folder)
    assert model.cfg.n_layers == 3 and model.cfg.d_vocab == 101
    assert model.unembed.weight is model.embed.weight  # tied, whatever the file held
    assert not model.training
    assert_golden(model, hf, batch)
    # Eager attention (a hook on the pattern) gives the same numbers.
    assert_golden(model, hf, batch, fwd_hooks=[(lambda n: n.endswith("hook_pattern"), lambda x, h: None)])


@pytest.mark.parametrize("layout", ["prefixed+lm_head", "sharded"])
def test_untied_layouts_load_with_golden_parity(hf_untied, tmp_path, layout, batch):
    folder = LAYOUTS[layout](hf_untied, tmp_path / layout)
    model = HookedTransformer.from_pretrained(folder)
    assert not model.cfg.tie_word_embeddings
    assert model.unembed.weight is not model.embed.weight
    assert torch.equal(model.unembed.weight, hf_untied.lm_head.weight)
    assert_golden(model, hf_untied, batch)


def test_shard_count_does_not_matter(hf, tmp_path, batch):
    two = HookedTransformer.from_pretrained(layout_sharded(hf, tmp_path / "two", n_shards=2))
    three = HookedTransformer.from_pretrained(layout_sharded(hf, tmp_path / "three", n_shards=3))
    with torch.no_grad():
        assert torch.equal(two(batch), three(batch))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_is_honoured(hf, tmp_path, dtype, batch):
    model = HookedTransformer.from_pretrained(layout_bare_tied(hf, tmp_path / "m"), dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    with torch.no_grad():
        logits = model(batch)
        want = hf(batch).logits
    assert logits.dtype == dtype
    if dtype == torch.float64:
        assert max_diff(logits, want) <= ATOL
    else:  # bf16 keeps ~3 significant digits; the logits still track the fp32 reference
        assert max_diff(logits, want) <= 0.05 * want.abs().max().item()
        assert (logits.float().argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_device_is_honoured(hf, tmp_path):
    folder = layout_bare_tied(hf, tmp_path / "m")
    model = HookedTransformer.from_pretrained(folder, device=torch.device("cpu"))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    meta = HookedTransformer.from_pretrained(folder, device="meta")  # a device other than the file's, no GPU needed
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert meta.unembed.weight is meta.embed.weight
    if torch.cuda.is_available():
        cuda = HookedTransformer.from_pretrained(folder, device="cuda")
        assert {p.device.type for p in cuda.parameters()} == {"cuda"}
        tokens = torch.randint(0, 101, (2, 9))
        with torch.no_grad():
            assert max_diff(cuda(tokens).cpu(), model(tokens)) <= ATOL


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_our_save_loads_in_transformers(hf, hf_untied, tmp_path, which, batch):
    source = hf if which == "tied" else hf_untied
    ours = HookedTransformer.from_hf(source)
    ours.save_pretrained(tmp_path / "saved")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"), attn_implementation="eager").eval()
    with torch.no_grad():
        assert max_diff(theirs(batch).logits, ours(batch)) <= ATOL
        assert max_diff(theirs(batch).logits, source(batch).logits) <= ATOL
    again = HookedTransformer.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(again(batch), ours(batch))
    assert again.cfg.replace(name="x") == ours.cfg.replace(name="x")


def test_from_hf_accepts_gpt2model(hf, batch):
    # A bare GPT2Model (no LM head) converts too; its logits come from the tied embedding.
    model = HookedTransformer.from_hf(hf.transformer)
    with torch.no_grad():
        assert max_diff(model(batch), hf(batch).logits) <= ATOL


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
    cfg["activation_function"] = "relu"
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


@pytest.mark.parametrize("dtype", ["bf16", "int8", torch.int64, 3])
def test_bad_dtype_is_refused(hf, tmp_path, dtype):
    folder = layout_bare_tied(hf, tmp_path / "m")
    with pytest.raises(ValueError, match=r"dtype=.*not supported.*bfloat16"):
        HookedTransformer.from_pretrained(folder, dtype=dtype)


def test_same_dtype_checkpoint_is_assigned_without_a_copy(tmp_path, monkeypatch):
    """Weights already in the asked dtype are the tensors read from the file (memory-mapped), not copies;
    another dtype converts once."""
    import lenskit.io.loading
    from conftest import make_hf_family

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

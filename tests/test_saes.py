"""lenskit.saes: each published format read and computed exactly as its own definition, by hand from the weights;
damaged or foreign files refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from sae_files import (
    circuit_tracer_file,
    dictionary_learning_pt,
    gemma_scope_npz,
    rand,
    saelens_folder,
    sparsify_folder,
)

from lenskit.saes import SAE, SAEFileError
from lenskit.saes.formats import gemma_scope_hook, sparsify_hook

D_IN, D_SAE = 16, 40


@pytest.fixture
def x() -> torch.Tensor:
    return rand(3, 5, D_IN, seed=11, scale=1.0)


def hand_topk(pre: torch.Tensor, k: int) -> torch.Tensor:
    kth = pre.sort(dim=-1, descending=True).values[..., k - 1 : k]
    return torch.relu(pre) * (pre >= kth)


@pytest.mark.parametrize("v6", [True, False])
def test_saelens_standard(tmp_path, x, v6):
    w = saelens_folder(tmp_path / "s", D_IN, D_SAE, hook="blocks.2.hook_resid_post", v6=v6)
    sae = SAE.load(tmp_path / "s")
    assert sae.hook_name == "blocks.2.hook_resid_post" and sae.cfg.format == "saelens"
    f = torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    torch.testing.assert_close(sae.encode(x), f)
    torch.testing.assert_close(sae.decode(f), f @ w["W_dec"] + w["b_dec"])
    torch.testing.assert_close(sae(x), f @ w["W_dec"] + w["b_dec"])
    assert (sae.encode(x) == 0).any() and (sae.encode(x) > 0).any()


def test_saelens_topk_old_and_new_spelling(tmp_path, x):
    w = saelens_folder(tmp_path / "new", D_IN, D_SAE, arch="topk", k=5)
    saelens_folder(tmp_path / "old", D_IN, D_SAE, arch="standard", v6=False, activation_fn_str="topk",
                   activation_fn_kwargs={"k": 5})
    want = hand_topk((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"], 5)
    for name in ("new", "old"):
        f = SAE.load(tmp_path / name).encode(x)
        torch.testing.assert_close(f, want)
        assert int((f != 0).sum(-1).max()) <= 5


def test_saelens_jumprelu_and_gated(tmp_path, x):
    w = saelens_folder(tmp_path / "j", D_IN, D_SAE, arch="jumprelu")
    pre = (x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]
    torch.testing.assert_close(SAE.load(tmp_path / "j").encode(x), pre * (pre > w["threshold"]) * (pre > 0))
    g = saelens_folder(tmp_path / "g", D_IN, D_SAE, arch="gated")
    shared = (x - g["b_dec"]) @ g["W_enc"]
    want = (shared + g["b_gate"] > 0) * torch.relu(shared * g["r_mag"].exp() + g["b_mag"])
    torch.testing.assert_close(SAE.load(tmp_path / "g").encode(x), want)


def test_saelens_dtype_follows_input(tmp_path, x):
    saelens_folder(tmp_path / "s", D_IN, D_SAE)
    sae = SAE.load(tmp_path / "s")
    out = sae(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), sae(x.to(torch.bfloat16).float()), atol=0.05, rtol=0.05)


def test_gemma_scope_npz_and_folder_naming(tmp_path, x):
    folder = tmp_path / "gemma-scope-2b-pt-res" / "layer_1" / "width_16k" / "average_l0_82"
    w = gemma_scope_npz(folder / "params.npz", D_IN, D_SAE)
    sae = SAE.load(folder)
    assert sae.hook_name == "blocks.1.hook_resid_post" and sae.cfg.architecture == "jumprelu"
    pre = x @ w["W_enc"] + w["b_enc"]  # Gemma Scope does not subtract b_dec first
    f = torch.relu(pre) * (pre > w["threshold"])
    torch.testing.assert_close(sae.encode(x), f)
    torch.testing.assert_close(sae(x), f @ w["W_dec"] + w["b_dec"])
    assert SAE.load(folder / "params.npz", hook="blocks.0.hook_mlp_out").hook_name == "blocks.0.hook_mlp_out"
    assert gemma_scope_hook("google/gemma-scope-9b-pt-mlp", "layer_20/width_131k/average_l0_9") == "blocks.20.hook_mlp_out"
    assert gemma_scope_hook("google/gemma-scope-2b-pt-transcoders", "layer_3/width_16k/x") == (
        "blocks.3.ln2.hook_normalized", "blocks.3.hook_mlp_out")
    assert gemma_scope_hook("someone/else", "layer_3") is None


def test_sparsify_topk_and_hook_names(tmp_path, x):
    w = sparsify_folder(tmp_path / "layers.2", D_IN, D_SAE, k=6)
    sae = SAE.load(tmp_path / "layers.2")
    assert sae.hook_name == "blocks.2.hook_resid_post" and sparsify_hook("layers.4.mlp") == "blocks.4.hook_mlp_out"
    pre = (x - w["b_dec"]) @ w["encoder.weight"].T + w["encoder.bias"]
    f = hand_topk(torch.relu(pre), 6)
    torch.testing.assert_close(sae.encode(x), f)
    torch.testing.assert_close(sae.decode(f), f @ w["W_dec"] + w["b_dec"])


def test_sparsify_skip_transcoder(tmp_path, x):
    w = sparsify_folder(tmp_path / "layers.1.mlp", D_IN, D_SAE, k=4, transcode=True, skip=True)
    with pytest.raises(SAEFileError, match="hook=\\(input_hook, output_hook\\)"):
        SAE.load(tmp_path / "layers.1.mlp")
    sae = SAE.load(tmp_path / "layers.1.mlp", hook=("blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out"))
    assert sae.cfg.is_transcoder
    f = hand_topk(torch.relu(x @ w["encoder.weight"].T + w["encoder.bias"]), 4)  # a transcoder keeps x as it is
    torch.testing.assert_close(sae(x), f @ w["W_dec"] + w["b_dec"] + x @ w["W_skip"].T)


def test_circuit_tracer_skip_transcoder(tmp_path, x):
    w = circuit_tracer_file(tmp_path / "layer_1.safetensors", D_IN, D_SAE)
    sae = SAE.load(tmp_path / "layer_1.safetensors", hook=("blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out"))
    pre = x @ w["W_enc"].T + w["b_enc"]
    f = torch.relu(pre) * (pre > w["activation_function.threshold"])
    torch.testing.assert_close(sae.encode(x), f)
    torch.testing.assert_close(sae(x), f @ w["W_dec"] + w["b_dec"] + x @ w["W_skip"].T)
    with pytest.raises(ValueError, match="skip connection"):
        sae.decode(f)


@pytest.mark.parametrize("topk", [None, 3])
def test_dictionary_learning_through_the_safe_reader(tmp_path, x, topk):
    w = dictionary_learning_pt(tmp_path / "ae.pt", D_IN, D_SAE, topk=topk)
    sae = SAE.load(tmp_path, hook="blocks.0.hook_resid_post")
    bias = w["bias"] if topk is None else w["b_dec"]
    pre = (x - bias) @ w["encoder.weight"].T + w["encoder.bias"]
    f = torch.relu(pre) if topk is None else hand_topk(pre, topk)
    torch.testing.assert_close(sae.encode(x), f)
    torch.testing.assert_close(sae.decode(f), f @ w["decoder.weight"].T + bias)


def test_pickled_ae_pt_refused_without_running_it(tmp_path):
    class Boom:
        def __reduce__(self):
            return (exec, ("open('%s', 'w').write('ran')" % (tmp_path / "ran"),))

    torch.save({"encoder.weight": torch.zeros(2, 2), "x": Boom()}, tmp_path / "ae.pt")
    with pytest.raises(SAEFileError) as e:
        SAE.load(tmp_path / "ae.pt", hook="blocks.0.hook_resid_post")
    assert "\n" not in str(e.value) and not (tmp_path / "ran").exists()


def test_truncated_and_tampered_files_one_line(tmp_path):
    saelens_folder(tmp_path / "s", D_IN, D_SAE)
    blob = (tmp_path / "s" / "sae_weights.safetensors").read_bytes()
    (tmp_path / "s" / "sae_weights.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(SAEFileError, match="truncated or corrupt") as e:
        SAE.load(tmp_path / "s")
    assert "\n" not in str(e.value)
    np.savez(tmp_path / "params.npz", W_enc=np.array([object()], dtype=object))
    with pytest.raises(SAEFileError, match="pickled") as e:
        SAE.load(tmp_path / "params.npz", hook="blocks.0.hook_resid_post")
    assert "\n" not in str(e.value)
    gemma_scope_npz(tmp_path / "g" / "params.npz", D_IN, D_SAE)
    raw = dict(np.load(tmp_path / "g" / "params.npz"))
    raw["W_dec"] = raw["W_dec"][:, :-1]  # a tampered shape
    np.savez(tmp_path / "g" / "params.npz", **raw)
    with pytest.raises(ValueError, match="W_dec.*shape"):
        SAE.load(tmp_path / "g", hook="blocks.0.hook_resid_post")


@pytest.mark.parametrize("field,value,match", [
    ("architecture", "matryoshka", "architecture 'matryoshka'"),
    ("normalize_activations", "constant_norm_rescale", "constant_norm_rescale"),
    ("rescale_acts_by_decoder_norm", True, "rescale_acts_by_decoder_norm"),
    ("d_sae", "40", "d_sae"),
])
def test_saelens_settings_refused_by_name(tmp_path, field, value, match):
    saelens_folder(tmp_path / "s", D_IN, D_SAE)
    cfg = json.loads((tmp_path / "s" / "cfg.json").read_text())
    cfg[field] = value
    (tmp_path / "s" / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(SAEFileError, match=match):
        SAE.load(tmp_path / "s")


def test_not_an_sae_folder(tmp_path):
    with pytest.raises(SAEFileError, match="holds no SAE"):
        SAE.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no SAE at"):
        SAE.load(str(tmp_path / "absent"))


def test_save_round_trip_and_old_saelens_spellings(tmp_path, x):
    w = saelens_folder(tmp_path / "old", D_IN, D_SAE, v6=False)
    cfg = json.loads((tmp_path / "old" / "cfg.json").read_text())
    cfg["hook_point"] = cfg.pop("hook_name")  # SAELens <= 2
    cfg["normalize_activations"] = False  # SAELens <= 5's flag
    (tmp_path / "old" / "cfg.json").write_text(json.dumps(cfg))
    sae = SAE.load(tmp_path / "old")
    assert sae.hook_name == "blocks.1.hook_resid_pre"
    sae.save(tmp_path / "new")
    again = SAE.load(tmp_path / "new")
    saved = json.loads((tmp_path / "new" / "cfg.json").read_text())
    assert saved["metadata"]["hook_name"] == "blocks.1.hook_resid_pre" and saved["architecture"] == "standard"
    torch.testing.assert_close(again.encode(x), torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]))
    torch.testing.assert_close(again(x), sae(x))


def test_gemma_scope_from_the_offline_hub_cache(tmp_path, monkeypatch, x):
    repo_id, sub = "google/gemma-scope-2b-pt-res", "layer_1/width_16k/average_l0_82"
    repo = tmp_path / "cache" / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    w = gemma_scope_npz(repo / "blobs" / "a1b2c3", D_IN, D_SAE)
    (repo / "blobs" / "a1b2c3.npz").rename(repo / "blobs" / "a1b2c3")  # numpy added .npz; blobs are bare hashes
    link = repo / "snapshots" / commit / sub / "params.npz"
    link.parent.mkdir(parents=True)
    link.symlink_to(Path("../../../../../blobs/a1b2c3"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    sae = SAE.load(f"{repo_id}/{sub}")
    assert sae.hook_name == "blocks.1.hook_resid_post" and sae.cfg.format == "gemma_scope"
    pre = x @ w["W_enc"] + w["b_enc"]
    torch.testing.assert_close(sae.encode(x), torch.relu(pre) * (pre > w["threshold"]))
    with pytest.raises(OSError, match="not in the local Hugging Face cache|no SAE files"):
        SAE.load(f"{repo_id}/layer_2/width_16k/average_l0_82")


def test_saelens_skip_transcoder(tmp_path, x):
    folder = tmp_path / "tc"
    w = saelens_folder(folder, D_IN, D_SAE, arch="skip_transcoder", hook="blocks.1.ln2.hook_normalized", v6=True,
                       apply_b_dec_to_input=False)
    w["W_skip"] = rand(D_IN, D_IN, seed=9)
    from safetensors.torch import save_file

    save_file(w, str(folder / "sae_weights.safetensors"))
    cfg = json.loads((folder / "cfg.json").read_text())
    cfg["metadata"]["hook_name_out"] = "blocks.1.hook_mlp_out"
    cfg["d_out"] = D_IN
    (folder / "cfg.json").write_text(json.dumps(cfg))
    sae = SAE.load(folder)
    assert (sae.hook_name, sae.hook_name_out) == ("blocks.1.ln2.hook_normalized", "blocks.1.hook_mlp_out")
    f = torch.relu(x @ w["W_enc"] + w["b_enc"])
    torch.testing.assert_close(sae(x), f @ w["W_dec"] + w["b_dec"] + x @ w["W_skip"].T)

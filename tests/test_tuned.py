"""TunedLens: identity at init, the translator maths, save/load, fingerprints, and tuned-lens import."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from conftest import make_hf_gpt2
from families import every_family

import lenskit
from lenses import LogitLens, TunedLens
from lenses.card import model_card
from lenses.tuned import model_fingerprint
from lenskit import Stream


def hf_decode(hf_model, h):
    """The reference decoder: transformers' own final LayerNorm and LM head."""
    return hf_model.lm_head(hf_model.transformer.ln_f(h))


def randomize(lens: TunedLens, seed: int = 0) -> TunedLens:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lens.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return lens


@pytest.fixture
def streams(model, tokens):
    _, cache = model.run_with_cache(tokens)
    return cache


def test_untrained_tuned_lens_is_the_logit_lens_at_every_layer(model, hf_model, tokens, streams):
    tuned, logit = TunedLens(model), LogitLens(model)
    hidden = hf_model(tokens, output_hidden_states=True).hidden_states  # embeddings, block 0..n-1 outputs
    for l in range(model.cfg.n_layers + 1):
        h = streams.accumulated_resid()[l]
        assert torch.equal(tuned(h, l), logit(h, l))
        if l < model.cfg.n_layers:  # HF's last hidden state already has ln_f applied
            torch.testing.assert_close(tuned(h, l), hf_decode(hf_model, hidden[l]), atol=1e-5, rtol=1e-5)


def test_translator_is_residual_affine_and_absent_at_the_last_layer(model, hf_model, tokens, streams):
    tuned = randomize(TunedLens(model))
    n = model.cfg.n_layers
    assert len(tuned.translators) == n and tuned.translator(n) is None
    for l in range(n):
        h = streams.accumulated_resid()[l]
        A, b = tuned.translators[l].weight, tuned.translators[l].bias
        expected = hf_decode(hf_model, h + h @ A.T + b)
        torch.testing.assert_close(tuned(h, l), expected, atol=1e-5, rtol=1e-5)
    # Stream n_layers is the model's own output, whatever the translators hold.
    logits = hf_model(tokens).logits
    torch.testing.assert_close(tuned(streams.accumulated_resid()[n], n), logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(IndexError, match="out of range"):
        tuned(streams.accumulated_resid()[0], n + 1)


@every_family
def test_resid_mid_translators(model, streams):
    plain = TunedLens(model)
    with pytest.raises(ValueError, match="no resid_mid translators"):
        plain(streams["resid_mid", 0], Stream(0, "resid_mid"))
    tuned = randomize(TunedLens(model, resid_mid=True))
    h = streams["resid_mid", 1]
    t = tuned.mid_translators[1]
    torch.testing.assert_close(tuned(h, Stream(1, "resid_mid")), LogitLens(model)(h + t(h), 1))
    torch.testing.assert_close(tuned.decode(streams, 1, "resid_mid"), tuned(h, Stream(1, "resid_mid")))
    with pytest.raises(IndexError):
        tuned(h, Stream(model.cfg.n_layers, "resid_mid"))  # there is no resid_mid after the last block
    assert len(list(tuned.parameters())) == 4 * model.cfg.n_layers


@every_family
def test_save_load_gives_identical_outputs_and_no_pickle(model, streams, tmp_path):
    tuned = randomize(TunedLens(model, resid_mid=True))
    tuned.info = {"tokens_seen": 123}
    tuned.save(tmp_path / "lens")
    assert sorted(p.name for p in (tmp_path / "lens").iterdir()) == ["README.md", "config.json", "lens.safetensors"]
    raw = (tmp_path / "lens" / "lens.safetensors").read_bytes()
    assert not raw.startswith(b"\x80")  # not a pickle; safetensors starts with its header length
    header_len = int.from_bytes(raw[:8], "little")
    assert json.loads(raw[8: 8 + header_len])  # a JSON header, as safetensors defines
    config = json.loads((tmp_path / "lens" / "config.json").read_text())
    assert config["n_layers"] == model.cfg.n_layers and config["d_model"] == model.cfg.d_model
    assert config["model_fingerprint"] == model_fingerprint(model) and config["tokens_seen"] == 123
    loaded = TunedLens.load(tmp_path / "lens", model)
    assert loaded.has_mid and loaded.info["tokens_seen"] == 123
    for l in range(model.cfg.n_layers + 1):
        h = streams.accumulated_resid()[l]
        assert torch.equal(loaded(h, l), tuned(h, l))
    assert torch.equal(loaded(streams["resid_mid", 0], Stream(0, "resid_mid")), tuned(streams["resid_mid", 0], Stream(0, "resid_mid")))


def test_loading_onto_a_model_with_another_fingerprint_is_refused(model, tmp_path):
    TunedLens(model).save(tmp_path / "lens")
    other = lenskit.HookedTransformer.from_hf(make_hf_gpt2(seed=1))  # same shapes, different weights
    with pytest.raises(ValueError) as err:
        TunedLens.load(tmp_path / "lens", other)
    assert model_fingerprint(model) in str(err.value) and model_fingerprint(other) in str(err.value)
    bigger = lenskit.HookedTransformer.from_hf(make_hf_gpt2(n_layer=4))
    with pytest.raises(ValueError, match="n_layers=3 but the model has n_layers=4"):
        TunedLens.load(tmp_path / "lens", bigger)


@pytest.mark.slow  # starts a fresh Python process
def test_fingerprint_is_a_hash_of_the_values_alone(model, hf_model, tmp_path):
    # Independent recomputation with hashlib and numpy, straight from transformers' tensors.
    digest = hashlib.sha256()
    for name, t in [("ln_final.bias", hf_model.transformer.ln_f.bias), ("ln_final.weight", hf_model.transformer.ln_f.weight),
                    ("unembed.weight", hf_model.lm_head.weight)]:
        arr = t.detach().numpy().astype("<f4")
        digest.update(f"{name}:{list(arr.shape)}\n".encode() + arr.tobytes())
    assert model_fingerprint(model) == "gpt2:sha256:" + digest.hexdigest()
    # Same after a round trip through files, in a fresh process.
    model.save_pretrained(tmp_path / "m")
    code = ("import lenskit; from lenses.tuned import model_fingerprint; "
            f"print(model_fingerprint(lenskit.HookedTransformer.from_pretrained({str(tmp_path / 'm')!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == model_fingerprint(model)
    # One ulp in the final norm changes it.
    moved = lenskit.HookedTransformer.from_pretrained(tmp_path / "m")
    with torch.no_grad():
        moved.ln_final.weight[0] = torch.nextafter(moved.ln_final.weight[0], torch.tensor(10.0))
    assert model_fingerprint(moved) != out


def write_tuned_lens_package_folder(folder, state, n_layers, d_model, bias=True):
    """The tuned-lens package's layout: config.json (TunedLensConfig) + params.pt (a torch.save'd state dict)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"base_model_name_or_path": "tiny", "d_model": d_model, "num_hidden_layers": n_layers, "bias": bias,
              "base_model_revision": None, "unembed_hash": "abc", "lens_type": "linear_tuned_lens"}
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(state, folder / "params.pt")


@every_family
@pytest.mark.parametrize("prefix", ["", "layer_translators."])
def test_import_a_lens_saved_by_the_tuned_lens_package(model, streams, tmp_path, prefix):
    n, d = model.cfg.n_layers, model.cfg.d_model
    g = torch.Generator().manual_seed(3)
    state = {}
    for i in range(n):
        state[f"{prefix}{i}.weight"] = torch.randn(d, d, generator=g) * 0.1
        state[f"{prefix}{i}.bias"] = torch.randn(d, generator=g) * 0.1
    write_tuned_lens_package_folder(tmp_path / "tl", state, n, d)
    lens = TunedLens.load(tmp_path / "tl", model)
    for l in range(n):
        h = streams.accumulated_resid()[l]
        W, b = state[f"{prefix}{l}.weight"], state[f"{prefix}{l}.bias"]
        torch.testing.assert_close(lens(h, l), LogitLens(model)(h + h @ W.T + b, l))
    assert lens.info["imported_from"]["format"] == "tuned-lens"
    # Converted, it saves as a lenskit folder and loads back the same.
    lens.save(tmp_path / "converted")
    again = TunedLens.load(tmp_path / "converted", model)
    assert torch.equal(again(streams["resid_pre", 1], 1), lens(streams["resid_pre", 1], 1))


class NotATensor:
    pass


@every_family
def test_tuned_lens_import_never_unpickles_objects_and_checks_shapes(model, tmp_path):
    n, d = model.cfg.n_layers, model.cfg.d_model
    state = {f"{i}.{k}": torch.zeros(d, d) if k == "weight" else torch.zeros(d) for i in range(n) for k in ("weight", "bias")}
    state["0.weight"] = NotATensor()  # a pickled custom class: weights_only refuses it
    write_tuned_lens_package_folder(tmp_path / "evil", state, n, d)
    with pytest.raises(ValueError, match="not a plain tensor file.*was executed"):
        TunedLens.load(tmp_path / "evil", model)
    state["0.weight"] = torch.zeros(d, d + 1)
    write_tuned_lens_package_folder(tmp_path / "bad", state, n, d)
    with pytest.raises(ValueError, match=r"translators\.0\.weight has shape \(32, 33\), expected \(32, 32\)"):
        TunedLens.load(tmp_path / "bad", model)
    write_tuned_lens_package_folder(tmp_path / "deep", state, n + 1, d)
    with pytest.raises(ValueError, match="n_layers=4 but the model has n_layers=3"):
        TunedLens.load(tmp_path / "deep", model)


def test_not_a_lens_folder(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        TunedLens.load(tmp_path, model)
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": 3}))
    with pytest.raises(ValueError, match="not a lenskit tuned lens"):
        TunedLens.load(tmp_path, model)


def test_fingerprint_uses_float32_bytes_whatever_the_storage(model):
    wide = lenskit.HookedTransformer.from_hf(make_hf_gpt2()).to(torch.float64)
    assert model_fingerprint(wide) == model_fingerprint(model)  # float64 copies of the same float32 values


def test_lens_folders_written_before_streams_still_load(model, streams, tmp_path):
    """The file format did not move with the API: config.json keys and the safetensors key names
    (`translators.{l}`, `mid_translators.{l}`) that existing lens folders hold, written here by hand."""
    from safetensors.torch import save_file

    n, d = model.cfg.n_layers, model.cfg.d_model
    g = torch.Generator().manual_seed(5)
    weights = {}
    for prefix in ("translators", "mid_translators"):
        for l in range(n):
            weights[f"{prefix}.{l}.weight"] = torch.randn(d, d, generator=g) * 0.05
            weights[f"{prefix}.{l}.bias"] = torch.randn(d, generator=g) * 0.05
    folder = tmp_path / "old_lens"
    folder.mkdir()
    save_file(weights, str(folder / "lens.safetensors"), metadata={"format": "lenskit-tuned-lens"})
    family, legacy = model_fingerprint(model).split(":", 1)  # then "sha256:<hex>", without the family
    assert family == model.cfg.family and legacy.startswith("sha256:")
    config = {"format": "lenskit-tuned-lens", "format_version": 1, "model_fingerprint": legacy,
              "model_name": model.cfg.name, "n_layers": n, "d_model": d, "d_vocab": model.cfg.d_vocab,
              "resid_mid": True, "weights": "lens.safetensors", "steps_done": 7}
    (folder / "config.json").write_text(json.dumps(config))
    lens = TunedLens.load(folder, model)  # the family unknown: matched by the digest alone
    assert lens.has_mid and lens.info == {"steps_done": 7} and lens.fingerprint == model_fingerprint(model)
    for wrong, refusal in (("sha256:" + "0" * 64, "trained for another model"),
                           ("llama:" + legacy, "trained for another model"),
                           ("sha256:xyz", "'model_fingerprint' must be")):
        (folder / "config.json").write_text(json.dumps(dict(config, model_fingerprint=wrong)))
        with pytest.raises(ValueError, match=refusal):
            TunedLens.load(folder, model)
    (folder / "config.json").write_text(json.dumps(config))
    logit = LogitLens(model)
    with torch.no_grad():
        for l in range(n):
            h, W, b = streams["resid_pre", l], weights[f"translators.{l}.weight"], weights[f"translators.{l}.bias"]
            torch.testing.assert_close(lens(h, l), logit(h + h @ W.T + b, l))
            m, W, b = streams["resid_mid", l], weights[f"mid_translators.{l}.weight"], weights[f"mid_translators.{l}.bias"]
            torch.testing.assert_close(lens(m, Stream(l, "resid_mid")), logit(m + m @ W.T + b, l))


# ------------------------------------------------------------------ lens folders for the Hub
def test_save_writes_a_model_card_with_front_matter_recipe_and_data(model, tmp_path):
    lens = TunedLens(model)
    lens.info = {"recipe": {"steps": 7, "lr": 0.1}, "steps_done": 7, "tokens_seen": 7 * 64,
                 "data": {"inputs": ["corpus/"], "n_files": 3, "n_tokens": 999, "sha256": "f00d" * 16, "files": []}}
    lens.save(tmp_path / "lens")
    config = json.loads((tmp_path / "lens" / "config.json").read_text())
    # A model loaded from a local folder has no hub id: the card says nothing it does not know.
    assert (tmp_path / "lens" / "README.md").read_text() == model_card(config) and "base_model" not in model_card(config)
    card = model_card({**config, "model_name": "openai-community/gpt2"})  # as when loaded by hub id
    front = card.split("---\n")[1]
    assert front.splitlines() == ["library_name: lenskit", "base_model: openai-community/gpt2", "tags:", "- tuned-lens",
                                  "- interpretability", "- lenskit"]
    assert "7 steps, 448 tokens." in card and "| lr | 0.1 |" in card
    assert '| sha256 | "' + "f00d" * 16 + '" |' in card and "| n_files | 3 |" in card
    assert "Not evaluated yet" in card
    assert model_card({**config, "model_name": "gpt2"}) == card  # the short name, under its organisation


def test_files_get_the_normal_umask_permissions(model, tmp_path):
    import os

    old = os.umask(0o022)
    try:
        TunedLens(model).save(tmp_path / "lens")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "lens").iterdir()}
    assert modes == {"config.json": 0o644, "lens.safetensors": 0o644, "README.md": 0o644}


def test_load_takes_a_hub_repo_id_from_the_local_cache_offline(model, streams, tmp_path, monkeypatch):
    import huggingface_hub

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--someone--tiny-tuned-lens"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    lens = randomize(TunedLens(model))
    lens.save(repo / "snapshots" / commit)
    monkeypatch.chdir(tmp_path)  # no folder named like the repo id in the working directory
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    real = huggingface_hub.snapshot_download

    def local_only(*args, **kwargs):
        assert kwargs.get("local_files_only"), "offline, nothing may try the network"
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", local_only)
    loaded = TunedLens.load("someone/tiny-tuned-lens", model)
    h = streams["resid_pre", 1]
    assert torch.equal(loaded(h, 1), lens(h, 1))
    with pytest.raises(OSError, match="not a hub repo in the local Hugging Face cache.*hf download someone/absent"):
        TunedLens.load("someone/absent", model)


def test_a_float32_lens_works_on_the_same_model_loaded_in_bfloat16(model, streams, tmp_path):
    lens = randomize(TunedLens(model))
    lens.save(tmp_path / "lens")
    model.save_pretrained(tmp_path / "model")
    bf16 = lenskit.HookedTransformer.from_pretrained(tmp_path / "model", dtype="bfloat16")
    loaded = TunedLens.load(tmp_path / "lens", bf16)
    assert loaded.translators[0].weight.dtype == torch.float32  # translators keep their precision
    h = streams["resid_pre", 1].to(torch.bfloat16)
    # Reference: the float32 translator on the bf16 stream, then the bf16 model's own readout.
    t = lens.translators[1]
    wide = h.float()
    expected = bf16.readout((wide + t(wide)).to(torch.bfloat16))
    assert torch.equal(loaded(h, 1), expected)
    # A lens trained on the bf16 model loads on the float32 one too (the same model, rounded).
    TunedLens(bf16).save(tmp_path / "bf16_lens")
    assert TunedLens.load(tmp_path / "bf16_lens", model).fingerprint == model_fingerprint(model)
    # Another model in bf16 is still refused, naming both dtypes.
    other = lenskit.HookedTransformer.from_hf(make_hf_gpt2(n_layer=model.cfg.n_layers, n_embd=model.cfg.d_model,
                                                           n_head=model.cfg.n_heads, vocab_size=model.cfg.d_vocab,
                                                           n_positions=model.cfg.n_ctx, seed=99)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="trained on a float32 model, this one is bfloat16"):
        TunedLens.load(tmp_path / "lens", other)


def test_a_failed_write_leaves_the_old_file_and_no_temporary_files(tmp_path):
    from lenses.io import write_atomic

    target = tmp_path / "config.json"
    target.write_text("old")

    def half_then_fail(tmp):
        tmp.write_text("half")
        (tmp.parent / ".tmpXYZ123").write_text("a writer's own temporary file")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(target, half_then_fail)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.json"]


# ------------------------------------------------------------------ bias-only lenses
def test_bias_only_lens_is_h_plus_b_and_round_trips_through_its_folder(model, streams, tmp_path):
    lens = randomize(TunedLens(model, resid_mid=True, bias_only=True))
    n, d = model.cfg.n_layers, model.cfg.d_model
    assert sorted(lens.state_dict()) == sorted(f"{p}.{l}.bias" for p in ("translators", "mid_translators") for l in range(n))
    assert all(p.shape == (d,) for p in lens.parameters())  # no A_l to hold at zero
    logit = LogitLens(model)
    for l in range(n):
        h = streams["resid_pre", l]
        torch.testing.assert_close(lens(h, l), logit(h + lens.translators[l].bias, l))
    lens.save(tmp_path / "lens")
    config = json.loads((tmp_path / "lens" / "config.json").read_text())
    assert config["bias_only"] is True and "bias_only" not in TunedLens.load(tmp_path / "lens", model).info
    card = (tmp_path / "lens" / "README.md").read_text()
    assert "# Bias-only tuned lens for" in card and "one learned bias per residual stream, h + b_l" in card
    loaded = TunedLens.load(tmp_path / "lens", model)
    assert loaded.bias_only and loaded.has_mid
    for l in range(n):
        h = streams["resid_pre", l]
        assert torch.equal(loaded(h, l), lens(h, l))
    assert "bias_only" in TunedLens(model).config() and TunedLens(model).config()["bias_only"] is False
    assert "h + A_l h + b_l" in model_card(TunedLens(model).config())
    (tmp_path / "lens" / "config.json").write_text(json.dumps({**config, "bias_only": "yes"}))
    with pytest.raises(ValueError, match="'bias_only' must be true or false"):
        TunedLens.load(tmp_path / "lens", model)


def test_bias_only_lens_in_float32_on_a_bfloat16_model(model, streams, tmp_path):
    lens = randomize(TunedLens(model, bias_only=True))
    model.save_pretrained(tmp_path / "model")
    bf16 = lenskit.HookedTransformer.from_pretrained(tmp_path / "model", dtype="bfloat16")
    lens.save(tmp_path / "lens")
    loaded = TunedLens.load(tmp_path / "lens", bf16)
    assert loaded.translators[1].bias.dtype == torch.float32
    h = streams["resid_pre", 1].to(torch.bfloat16)
    assert torch.equal(loaded(h, 1), bf16.readout((h.float() + lens.translators[1].bias).to(torch.bfloat16)))

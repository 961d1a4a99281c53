"""Jacobian lens files and fits that outlive a process: lens folders, the reference `.pt` both ways (and from
TransformerLens 4.3, against its own fit and readout), the hub cache, refusals, resuming, and torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_hf_family, make_hf_gpt2
from families import family_model_of
from lens_fixtures import write_tiny_model
from references import transformer_lens_4_3

import lenskit
from lenses import JacobianLens
from lenses.jacobian_fit import CHECKPOINT_FILE
from lenses.tuned import model_fingerprint


def random_lens(model, seed=0, streams=None):
    g = torch.Generator().manual_seed(seed)
    d = model.cfg.d_model
    streams = range(model.cfg.n_layers) if streams is None else streams
    return JacobianLens(model, {s: torch.eye(d) + torch.randn(d, d, generator=g) / d ** 0.5 for s in streams},
                        info={"estimator": {"skip_first_positions": 4, "exclude_last": True, "n_prompts": 9, "n_tokens": 99}})


@pytest.fixture
def cache(model, tokens):
    return model.run_with_cache(tokens)[1]


def same_readout(a, b, model, cache, streams, exact=True):
    for s in streams:
        h = cache.stream(s)
        if exact:
            assert torch.equal(a(h, s), b(h, s)), s
        else:
            torch.testing.assert_close(a(h, s), b(h, s), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ lens folders
def test_folder_round_trip_is_exact_and_holds_config_weights_and_card(model, cache, tmp_path):
    lens = random_lens(model)
    lens.info["data"] = {"inputs": ["corpus/"], "n_tokens": 99, "sha256": "f00d" * 16}
    lens.save(tmp_path / "lens")
    assert sorted(p.name for p in (tmp_path / "lens").iterdir()) == ["README.md", "config.json", "lens.safetensors"]
    config = json.loads((tmp_path / "lens" / "config.json").read_text())
    assert config["format"] == "lenskit-jacobian-lens" and config["format_version"] == 1
    assert config["model_fingerprint"] == model_fingerprint(model) and config["family"] == "gpt2"
    assert set(config["model_fingerprints_reduced"]) == {"bfloat16", "float16"}
    assert (config["n_layers"], config["d_model"], config["streams"]) == (3, 32, [0, 1, 2])
    assert config["estimator"] == {"skip_first_positions": 4, "exclude_last": True, "n_prompts": 9, "n_tokens": 99}
    from safetensors.torch import load_file

    assert sorted(load_file(str(tmp_path / "lens" / "lens.safetensors"))) == ["J.0", "J.1", "J.2"]
    card = (tmp_path / "lens" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: lenskit\ntags:\n- jacobian-lens\n") and "# Jacobian lens for" in card
    assert "JacobianLens.load" in card and "| skip_first_positions | 4 |" in card and "| n_tokens | 99 |" in card
    loaded = JacobianLens.load(tmp_path / "lens", model)
    assert loaded.streams == [0, 1, 2] and loaded.info == lens.info
    same_readout(loaded, lens, model, cache, range(4))


def test_a_float32_lens_folder_loads_on_the_same_model_in_bfloat16(model, cache, tmp_path):
    random_lens(model).save(tmp_path / "lens")
    model.save_pretrained(tmp_path / "model")
    bf16 = lenskit.HookedTransformer.from_pretrained(tmp_path / "model", dtype="bfloat16")
    loaded = JacobianLens.load(tmp_path / "lens", bf16)
    assert loaded.matrix(1).dtype == torch.float32 and loaded(cache.stream(1).bfloat16(), 1).dtype == torch.float32


def test_a_lens_for_another_model_is_refused_in_one_line(model, tmp_path):
    random_lens(model).save(tmp_path / "lens")
    other = lenskit.HookedTransformer.from_hf(make_hf_gpt2(seed=1))  # same shapes, other weights
    with pytest.raises(ValueError) as err:
        JacobianLens.load(tmp_path / "lens", other)
    assert model_fingerprint(model) in str(err.value) and model_fingerprint(other) in str(err.value)
    wider = lenskit.HookedTransformer.from_hf(make_hf_gpt2(n_embd=48))
    with pytest.raises(ValueError, match="d_model=32 but the model has d_model=48"):
        JacobianLens.load(tmp_path / "lens", wider)
    llama = family_model_of("llama").model  # also 3 blocks of d_model 32
    with pytest.raises(ValueError, match=r"fitted on a gpt2 model .* but this model is llama") as err:
        JacobianLens.load(tmp_path / "lens", llama)
    assert "\n" not in str(err.value)
    config = json.loads((tmp_path / "lens" / "config.json").read_text())
    for change, refusal in (({"streams": [0, 3]}, "'streams' must be a non-empty list"),
                            ({"format_version": 2}, "format_version 2 is not one this lenskit reads"),
                            ({"format": "lenskit-tuned-lens"}, "is not a Jacobian lens")):
        (tmp_path / "lens" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=refusal):
            JacobianLens.load(tmp_path / "lens", model)


# ------------------------------------------------------------------ the reference .pt
def test_save_reference_writes_the_reference_dict_without_stream_0(model, cache, tmp_path):
    lens = random_lens(model)
    path = lens.save_reference(tmp_path / "lens.pt")
    raw = torch.load(path, weights_only=True)
    assert set(raw) == {"J", "n_prompts", "source_layers", "d_model", "metadata"}
    assert sorted(raw["J"]) == raw["source_layers"] == [0, 1] and raw["n_prompts"] == 9 and raw["d_model"] == 32
    assert all(J.dtype == torch.float16 and J.shape == (32, 32) for J in raw["J"].values())
    assert torch.equal(raw["J"][0], lens.matrix(1).half())  # layer l = stream l + 1
    assert raw["metadata"]["target_layer"] == 2 and raw["metadata"]["lenskit"]["model_fingerprint"] == model_fingerprint(model)
    loaded = JacobianLens.load(path, model)
    assert loaded.streams == [1, 2] and loaded.info["estimator"]["n_prompts"] == 9
    assert torch.equal(loaded.matrix(1), lens.matrix(1).half().float())
    wide = JacobianLens.load(lens.save_reference(tmp_path / "wide.pt", dtype=torch.float32), model)
    same_readout(wide, lens, model, cache, [1, 2, 3])
    with pytest.raises(ValueError, match="trained for another model"):  # our metadata names the model: checked
        JacobianLens.load(path, lenskit.HookedTransformer.from_hf(make_hf_gpt2(seed=1)))
    with pytest.raises(ValueError, match="holds stream 0 only"):
        random_lens(model, streams=[0]).save_reference(tmp_path / "none.pt")


def test_a_reference_fit_checkpoint_loads_as_its_mean(model, tmp_path):
    g = torch.Generator().manual_seed(1)
    sums = {0: torch.randn(32, 32, generator=g), 1: torch.randn(32, 32, generator=g)}
    torch.save({"jacobian_sum": sums, "n_done": 4, "next_idx": 4, "source_layers": [0, 1], "target_layer": 2,
                "skip_first": 16}, tmp_path / "ckpt.pt")
    lens = JacobianLens.load(tmp_path / "ckpt.pt", model)
    assert lens.streams == [1, 2] and lens.info["estimator"] == {"n_prompts": 4}
    torch.testing.assert_close(lens.matrix(2), sums[1] / 4)
    torch.save({"jacobian_sum": sums, "n_done": 4, "target_layer": 1}, tmp_path / "other_target.pt")
    with pytest.raises(ValueError, match="maps layer 1 to the output"):
        JacobianLens.load(tmp_path / "other_target.pt", model)
    torch.save({"jacobian_sum": sums, "n_done": 0}, tmp_path / "empty.pt")
    with pytest.raises(ValueError, match="'n_done' must be an integer >= 1"):
        JacobianLens.load(tmp_path / "empty.pt", model)


class WritesAFile:
    """Unpickling this would create `path`: the file must never appear."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_reference_files_are_never_unpickled_and_every_field_is_checked(model, tmp_path):
    good = {"J": {0: torch.zeros(32, 32), 1: torch.zeros(32, 32)}, "n_prompts": 3, "source_layers": [0, 1], "d_model": 32}
    marker = tmp_path / "pwned"
    torch.save({**good, "metadata": {"x": WritesAFile(marker)}}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="pickled Python objects.*nothing in it was executed") as err:
        JacobianLens.load(tmp_path / "evil.pt", model)
    assert not marker.exists() and "\n" not in str(err.value)

    torch.save(good, tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.pt") as err:
        JacobianLens.load(tmp_path / "cut.pt", model)
    assert "\n" not in str(err.value)

    for name, payload, refusal in [
        ("shape", {**good, "J": {0: torch.zeros(32, 31)}, "source_layers": [0]}, r"layer 0 has shape \(32, 31\), expected \(32, 32\)"),
        ("layer", {**good, "J": {2: torch.zeros(32, 32)}, "source_layers": [2]}, r"layer\(s\) \[2\].*0\.\.1"),
        ("width", {**good, "d_model": 64}, "d_model=64, but the model has d_model=32"),
        ("nan", {**good, "J": {0: torch.full((32, 32), float("nan"))}, "source_layers": [0]}, "NaN or inf"),
        ("listed", {**good, "source_layers": [0]}, r"source_layers \[0\] do not match"),
        ("device", {**good, "metadata": {"where": torch.device("cpu")}}, r"\['where'\] holds a device"),
        ("strkey", {**good, "J": {"0": torch.zeros(32, 32)}, "source_layers": ["0"]}, r"layer\(s\) \['0'\]"),
        ("nothing", {"weights": torch.zeros(3)}, "expected a dict with 'J'"),
    ]:
        torch.save(payload, tmp_path / f"{name}.pt")
        with pytest.raises(ValueError, match=refusal):
            JacobianLens.load(tmp_path / f"{name}.pt", model)


# ------------------------------------------------------------------ the hub cache
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_load_by_hub_repo_id_and_filename_from_the_cache_offline(model, cache, tmp_path, monkeypatch):
    import huggingface_hub

    repo = tmp_path / "hub" / "models--someone--jacobian-lens"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    lens = random_lens(model)
    lens.save_reference(snapshot / "gpt2-tiny" / "lens.pt", dtype=torch.float32)
    folder_repo = tmp_path / "hub" / "models--someone--jacobian-folder"
    (folder_repo / "refs").mkdir(parents=True)
    (folder_repo / "refs" / "main").write_text(COMMIT)
    lens.save(folder_repo / "snapshots" / COMMIT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = []
    for name in ("hf_hub_download", "snapshot_download"):
        real = getattr(huggingface_hub, name)

        def local_only(*args, real=real, **kwargs):
            calls.append(kwargs)
            assert kwargs.get("local_files_only"), "offline, nothing may try the network"
            return real(*args, **kwargs)

        monkeypatch.setattr(huggingface_hub, name, local_only)
    from_file = JacobianLens.load("someone/jacobian-lens", model, filename="gpt2-tiny/lens.pt")
    same_readout(from_file, lens, model, cache, [1, 2, 3])
    from_folder = JacobianLens.load("someone/jacobian-folder", model)
    same_readout(from_folder, lens, model, cache, range(4))
    assert calls
    with pytest.raises(OSError, match=r"'absent.pt' of hub repo 'someone/jacobian-lens' is not in the local Hugging Face cache"):
        JacobianLens.load("someone/jacobian-lens", model, filename="absent.pt")


# ------------------------------------------------------------------ resuming
def test_a_resumed_fit_is_exactly_an_uninterrupted_one(tmp_path, capsys):
    model = lenskit.HookedTransformer.from_hf(make_hf_gpt2())
    tokens = torch.randint(0, 101, (7, 10), generator=torch.Generator().manual_seed(5))
    settings = dict(skip_first_positions=2, streams=[0, 2], progress=False, checkpoint_every=2)
    whole = JacobianLens.fit(model, tokens, **settings)
    out = tmp_path / "run"
    for error, k, next_index in ((RuntimeError("boom"), 5, 4), (KeyboardInterrupt(), 2, 5)):  # then Ctrl-C on the 2nd resumed prompt
        calls = []

        def fail(x, hook):  # fails during the k-th forward of this call
            calls.append(1)
            if len(calls) == k:
                raise error

        remove = model.hook_dict["hook_embed"].add_hook(fail)
        try:
            with pytest.raises(type(error)):
                JacobianLens.fit(model, tokens, out=out, **settings)
        finally:
            remove()
        assert sorted(p.name for p in out.iterdir()) == [CHECKPOINT_FILE]  # the lock is released
        from safetensors import safe_open

        with safe_open(str(out / CHECKPOINT_FILE), "pt") as f:
            assert json.loads(f.metadata()["meta"])["next_index"] == next_index
    with pytest.raises(ValueError, match=r"belongs to a different run: estimator .* differ") as err:
        JacobianLens.fit(model, tokens, out=out, **{**settings, "skip_first_positions": 3})
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="tokens_sha256 .* differ"):
        JacobianLens.fit(model, tokens.flip(0), out=out, **settings)
    resumed = JacobianLens.fit(model, tokens, out=out, **settings)
    assert "resuming the Jacobian lens fit at prompt 5 of 7" in capsys.readouterr().out
    for s in (0, 2):
        assert torch.equal(resumed.matrix(s), whole.matrix(s)), s
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "lens.safetensors"]
    again = JacobianLens.fit(model, tokens, out=out, **settings)  # finished: read back, not refitted
    assert "already fitted (7 prompts)" in capsys.readouterr().out and torch.equal(again.matrix(2), whole.matrix(2))
    with pytest.raises(ValueError, match="belongs to a different run"):
        JacobianLens.fit(model, tokens, out=out, **{**settings, "streams": [1]})


SCRIPT = """
import os, sys, torch, lenskit
from lenses import JacobianLens
from lenses.training import init_distributed
rank, world, _ = init_distributed()
model = lenskit.HookedTransformer.from_pretrained(sys.argv[1])
tokens = torch.randint(0, model.cfg.d_vocab, (5, 12), generator=torch.Generator().manual_seed(0))
JacobianLens.fit(model, tokens, skip_first_positions=2, out=sys.argv[2], progress=False, checkpoint_every=2)
os.write(1, f"world {world}\\n".encode())  # one write per rank: print's pieces from two ranks can interleave
"""


@pytest.mark.slow  # two fresh processes under torchrun
def test_torchrun_two_ranks_match_one_process(tmp_path):
    model_dir = write_tiny_model(tmp_path / "model")
    (tmp_path / "fit.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(tmp_path / "fit.py"), str(model_dir), str(tmp_path / "ddp")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("world 2") == 2
    model = lenskit.HookedTransformer.from_pretrained(model_dir)
    tokens = torch.randint(0, model.cfg.d_vocab, (5, 12), generator=torch.Generator().manual_seed(0))
    single = JacobianLens.fit(model, tokens, skip_first_positions=2, progress=False)
    ddp = JacobianLens.load(tmp_path / "ddp", model)
    assert ddp.info["estimator"]["n_prompts"] == 5 and ddp.info["estimator"]["n_tokens"] == 60
    for s in single.streams:  # the same float64 sums, added in another order: float32 rounding at most
        torch.testing.assert_close(ddp.matrix(s), single.matrix(s), rtol=1e-6, atol=1e-7)
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == ["README.md", "config.json", "lens.safetensors"]


# ------------------------------------------------------------------ TransformerLens 4.3
@pytest.fixture(scope="module")
def transformer_lens():
    transformer_lens_4_3()
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.tools.analysis import JacobianLens as TLJacobianLens

    return TransformerBridge, TLJacobianLens


def both_models(family, folder, transformer_lens):
    """One random checkpoint folder (transformers' own classes), booted by TransformerLens and loaded by lenskit."""
    from tiny_tokenizer import CORPUS, VOCAB, make_tokenizer

    make_hf_family(family, vocab_size=VOCAB).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    bridge = transformer_lens[0].boot_transformers(str(folder), device="cpu").eval()
    texts = [text * 2 for text in CORPUS]
    # TransformerLens's fit tokenizes with its own to_tokens (which prepends BOS): give lenskit exactly those ids.
    ids = [bridge.to_tokens(t)[0] for t in texts]
    return bridge, lenskit.HookedTransformer.from_pretrained(folder), texts, ids


@pytest.mark.slow  # imports and boots TransformerLens
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fit_matches_transformer_lens(family, tmp_path, transformer_lens, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything is read from the local folder
    bridge, model, texts, ids = both_models(family, tmp_path / "model", transformer_lens)
    assert all(int(i[0]) == bridge.tokenizer.bos_token_id for i in ids)  # the BOS it prepends is in both
    theirs = transformer_lens[1].fit(bridge, texts, corpus="test", skip_first_positions=2, show_progress=False)
    ours = JacobianLens.fit(model, ids, skip_first_positions=2, streams=range(1, model.cfg.n_layers), progress=False)
    assert theirs.source_layers == [s - 1 for s in ours.streams] and theirs.n_prompts == 3
    for layer, J in theirs.jacobians.items():
        assert ((ours.matrix(layer + 1) - J).abs().max() / J.abs().max()).item() < 1e-4, layer

    # Their file in ours, and ours in theirs: each file read by both gives the same readout.
    theirs.save(str(tmp_path / "theirs.pt"))
    ours.save_reference(tmp_path / "ours.pt")
    prompt = ids[0][None]
    _, cache = model.run_with_cache(prompt)
    for file in ("theirs.pt", "ours.pt"):
        tl_lens = transformer_lens[1].load(str(tmp_path / file)).validate_model(bridge)
        our_lens = JacobianLens.load(tmp_path / file, model)
        assert our_lens.streams == [layer + 1 for layer in tl_lens.source_layers]
        readout = tl_lens.readout(bridge, prompt, return_full_logits=True)
        for layer in tl_lens.source_layers:
            s = layer + 1
            torch.testing.assert_close(our_lens(cache.stream(s), s)[0], readout.lens_logits[layer].float(),
                                       atol=2e-4, rtol=1e-4)

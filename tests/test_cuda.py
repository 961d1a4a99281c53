"""The GPU path: forward, cache, lenses, interventions and one tuned-lens training step with device="cuda",
compared against the same model on the CPU; hooks and lens readouts never synchronise with the host.
Skipped where no CUDA device is available (CI on CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_hf_family
from lens_fixtures import write_text_folder, write_tiny_model

from lenses import LogitLens, Trajectory, TunedLens
from lenses.training import Recipe, train
from lenskit import HookedTransformer
from lenskit.intervene.interventions import Head, Mlp, ablation_hooks
from lenskit.io.data import load_token_stream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    return write_tiny_model(root / "model"), write_text_folder(root / "data", n=120)


def tokens_for(d_vocab: int, batch: int = 2, pos: int = 12) -> torch.Tensor:
    return torch.randint(0, d_vocab, (batch, pos), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cuda_forward_and_cache_match_cpu(family):
    cpu = HookedTransformer.from_hf(make_hf_family(family))
    gpu = HookedTransformer.from_hf(make_hf_family(family).cuda())
    assert gpu.embed.weight.is_cuda
    tokens = tokens_for(cpu.cfg.d_vocab)
    with torch.no_grad():
        want, want_cache = cpu.run_with_cache(tokens)
        got, got_cache = gpu.run_with_cache(tokens.cuda())
    assert got.is_cuda and torch.allclose(got.cpu(), want, atol=1e-4, rtol=1e-4)
    assert set(got_cache) == set(want_cache)
    assert all(torch.allclose(got_cache[k].cpu(), want_cache[k], atol=1e-4, rtol=1e-4) for k in want_cache)


def test_from_pretrained_onto_cuda_in_bf16(folder):
    model_dir, _ = folder
    gpu = HookedTransformer.from_pretrained(model_dir, dtype="bfloat16", device="cuda")
    cpu = HookedTransformer.from_pretrained(model_dir, dtype="bfloat16")
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in gpu.parameters())
    tokens = tokens_for(cpu.cfg.d_vocab)
    with torch.no_grad():
        assert torch.allclose(gpu(tokens.cuda()).float().cpu(), cpu(tokens).float(), atol=5e-2)


def test_hooks_and_lens_readout_do_not_synchronise():
    """An ablated forward (from its first hook on) and a logit-lens readout queue GPU work only: any host
    synchronisation in there raises. (Checking the token ids, before the first hook, may synchronise.)"""
    gpu = HookedTransformer.from_hf(make_hf_family("gpt2").cuda())
    tokens = tokens_for(gpu.cfg.d_vocab).cuda()
    hooks = ablation_hooks(gpu, [Head(1, 2), Mlp(0)])  # building the hooks may read the model; running them may not

    def arm(x, hook):
        torch.cuda.set_sync_debug_mode("error")
        return x

    with torch.no_grad():
        _, cache = gpu.run_with_cache(tokens, names_filter=lambda n: n.endswith("resid_pre"))
        torch.cuda.synchronize()
        try:
            out = gpu.run_with_hooks(tokens, fwd_hooks=[("hook_embed", arm), *hooks])
            logits = LogitLens(gpu).decode(cache, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert out.is_cuda and logits.is_cuda and logits.dtype == torch.float32


def test_trajectory_on_cuda_matches_cpu(folder):
    model_dir, _ = folder
    cpu = HookedTransformer.from_pretrained(model_dir)
    gpu = HookedTransformer.from_pretrained(model_dir, device="cuda")
    text = "def add(a, b):\n    return a + b\n"
    want, got = Trajectory.from_prompt(LogitLens(cpu), text), Trajectory.from_prompt(LogitLens(gpu), text)
    assert torch.allclose(got.kl_to_final, want.kl_to_final, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tuned_lens_trains_on_cuda_with_one_sync_per_step(folder, dtype):
    model_dir, data_dir = folder
    gpu = HookedTransformer.from_pretrained(model_dir, dtype=dtype, device="cuda")
    stream = load_token_stream([data_dir], gpu.tokenizer)
    steps = 3
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lens = train(TunedLens(gpu), stream, Recipe(steps=steps, ctx=16, tokens_per_step=4 * 16, lr=0.5), progress=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert all(p.is_cuda and p.dtype == torch.float32 for p in lens.parameters())
    history = lens.info["loss_history"]
    assert len(history) == steps and all(torch.isfinite(torch.tensor(h)).all() for h in history)
    # Moving each step's windows to the GPU and the one copy of the step's log back; a few more for set-up.
    assert len(syncs) <= 3 * steps + 6, [str(w.message) for w in syncs[:10]]


# ------------------------------------------------------------------ activation offload
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cache_device_cpu_offloads_each_entry_into_pinned_memory(family):
    gpu = HookedTransformer.from_hf(make_hf_family(family).cuda())
    tokens = tokens_for(gpu.cfg.d_vocab).cuda()
    with torch.no_grad():
        logits, plain = gpu.run_with_cache(tokens)
        offloaded_logits, offloaded = gpu.run_with_cache(tokens, cache_device="cpu")
    assert offloaded_logits.is_cuda and torch.equal(offloaded_logits, logits) and list(offloaded) == list(plain)
    for name in plain:  # the same kernels ran: the copies are exact
        assert offloaded[name].device.type == "cpu" and offloaded[name].is_pinned(), name
        assert torch.equal(offloaded[name], plain[name].cpu()), name
    with torch.no_grad():
        _, cast = gpu.run_with_cache(tokens, cache_device="cpu", dtype=torch.bfloat16)
    assert all(torch.equal(cast[n], plain[n].to(torch.bfloat16).cpu()) for n in plain if plain[n].is_floating_point())


def test_cache_device_cpu_holds_no_gpu_memory_and_keeps_in_place_edits_out():
    gpu = HookedTransformer.from_hf(make_hf_family("gpt2").cuda())
    tokens = tokens_for(gpu.cfg.d_vocab, batch=8, pos=32).cuda()
    names = [f"blocks.{i}.hook_resid_post" for i in range(gpu.cfg.n_layers)]
    with torch.no_grad():
        gpu.run_with_cache(tokens, names, return_logits=False)  # warm up the allocator and any lazy tables
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        _, plain = gpu.run_with_cache(tokens, names, return_logits=False)
        on_gpu = torch.cuda.memory_allocated() - before
        del plain
        before = torch.cuda.memory_allocated()
        _, offloaded = gpu.run_with_cache(tokens, names, return_logits=False, cache_device="cpu")
        assert torch.cuda.memory_allocated() == before  # the cache lives on the host alone
    assert on_gpu >= len(names) * tokens.numel() * gpu.cfg.d_model * 4 and len(offloaded) == len(names)

    def zero(x, hook):
        x.zero_()  # queued after the copy of blocks.0.hook_resid_post, the same tensor

    with torch.no_grad():
        _, clean = gpu.run_with_cache(tokens, names)
        _, edited = gpu.run_with_cache(tokens, names + ["blocks.1.hook_resid_pre"], cache_device="cpu",
                                       fwd_hooks=[("blocks.1.hook_resid_pre", zero)])
    assert torch.equal(edited["blocks.0.hook_resid_post"], clean["blocks.0.hook_resid_post"].cpu())
    assert not edited["blocks.1.hook_resid_pre"].any()


# ------------------------------------------------------------------ device maps and offload (lenskit.placement)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """An untied tiny Llama of 3 blocks, so that the readout may sit apart from the embeddings."""
    path = tmp_path_factory.mktemp("llama")
    make_hf_family("llama", num_hidden_layers=3).save_pretrained(path)
    return path


def record(seen: dict, key: str, value) -> None:
    """A hook body that notes something and returns None: a hook's return value replaces the activation, and
    anything but a tensor or None is refused."""
    seen.setdefault(key, value)


def _matches_cpu(model: HookedTransformer, cpu: HookedTransformer) -> None:
    tokens = tokens_for(cpu.cfg.d_vocab)
    with torch.no_grad():
        want, want_cache = cpu.run_with_cache(tokens)
        got, got_cache = model.run_with_cache(tokens)
    assert torch.allclose(got.cpu(), want, atol=1e-4, rtol=1e-4)
    for name in want_cache:
        assert torch.allclose(got_cache[name].cpu(), want_cache[name], atol=1e-4, rtol=1e-4), name


@two_gpus
def test_a_device_map_across_two_gpus_matches_the_cpu(llama_folder):
    device_map = {"embed": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 1, "ln_final": 1, "unembed": 1}
    model = HookedTransformer.from_pretrained(llama_folder, device_map=device_map)
    assert model.blocks[0].attn.out.weight.device == torch.device("cuda:0")
    assert model.blocks[2].attn.out.weight.device == torch.device("cuda:1")
    seen = {}
    tokens = tokens_for(model.cfg.d_vocab)
    with torch.no_grad(), model.hooks([(lambda n: n.endswith("hook_resid_post"),
                                        lambda x, hook: record(seen, hook.name, x.device))]):
        model(tokens)
    assert seen["blocks.0.hook_resid_post"] == torch.device("cuda:0") and seen["blocks.1.hook_resid_post"] == torch.device("cuda:1")
    _matches_cpu(model, HookedTransformer.from_pretrained(llama_folder))
    auto = HookedTransformer.from_pretrained(llama_folder, device_map="auto")
    _matches_cpu(auto, HookedTransformer.from_pretrained(llama_folder))


def test_offloaded_blocks_compute_on_the_gpu_and_match_the_cpu(llama_folder):
    model = HookedTransformer.from_pretrained(llama_folder, device_map={"": "cuda:0", "blocks.1": "cpu", "blocks.2": "cpu"})
    assert model.placement.offloaded == {1, 2} and model.placement.main == torch.device("cuda:0")
    assert model.blocks[1].attn.out.weight.device.type == "cpu" and model.weight_files is not None  # still mapped
    seen = {}
    with torch.no_grad(), model.hooks([("blocks.2.hook_resid_post", lambda x, hook: record(seen, "d", x.device))]):
        model(tokens_for(model.cfg.d_vocab))
    assert seen["d"] == torch.device("cuda:0")  # computed on the GPU, weights copied for the call
    _matches_cpu(model, HookedTransformer.from_pretrained(llama_folder))


def test_the_lens_readout_runs_on_the_readout_device(llama_folder):
    model = HookedTransformer.from_pretrained(llama_folder, device_map={"": "cuda:0", "ln_final": "cpu", "unembed": "cpu"})
    cpu = HookedTransformer.from_pretrained(llama_folder)
    tokens = tokens_for(cpu.cfg.d_vocab)
    with torch.no_grad():
        got, want = Trajectory.from_prompt(LogitLens(model), tokens), Trajectory.from_prompt(LogitLens(cpu), tokens)
        assert torch.equal(got.top_ids.cpu(), want.top_ids)
        assert torch.allclose(got.kl_to_final.cpu(), want.kl_to_final, atol=1e-4)
        lens = TunedLens(model)
        h = model.run_with_cache(tokens)[1]["resid_post", 1]  # on cuda:0
        assert lens(h, 2).device == torch.device("cpu")  # read out where the readout lives
    from lenses.evaluation import evaluate_windows

    windows = torch.randint(0, cpu.cfg.d_vocab, (3, 16), generator=torch.Generator().manual_seed(1))
    got = evaluate_windows(model, [LogitLens(model), TunedLens(model)], windows, progress=False)
    want = evaluate_windows(cpu, [LogitLens(cpu), TunedLens(cpu)], windows, progress=False)
    assert (got[["kl", "ce", "entropy"]] - want[["kl", "ce", "entropy"]]).abs().max().max() < 1e-4


def test_activation_export_from_cuda_matches_the_cpu(tmp_path):
    from lenses.activation_export import export_activations
    from lenskit.io.activations import ActivationDataset

    cpu = HookedTransformer.from_hf(make_hf_family("llama"))
    gpu = HookedTransformer.from_hf(make_hf_family("llama").cuda())
    windows = tokens_for(cpu.cfg.d_vocab, batch=5, pos=12)
    export_activations(gpu, windows, "resid_post.0,resid_mid.1", tmp_path / "gpu", windows_per_shard=2, progress=False)
    export_activations(cpu, windows, "resid_post.0,resid_mid.1", tmp_path / "cpu", windows_per_shard=2, progress=False)
    for hook in ("resid_post.0", "resid_mid.1"):
        got, want = ActivationDataset(tmp_path / "gpu", hook), ActivationDataset(tmp_path / "cpu", hook)
        for w in range(5):
            torch.testing.assert_close(got.window(w)[0], want.window(w)[0], atol=1e-4, rtol=1e-4)
            assert torch.equal(got.window(w)[1], windows[w])


# ------------------------------------------------------------------ the command line on the GPU
def cli_commands(folder, tmp_path) -> dict[str, list[str]]:
    model_dir, data_dir = map(str, folder)
    return {
        "lens": ["lens", "x = 1", "--model", model_dir],
        "ablate": ["ablate", "x = alpha + 1", "--model", model_dir, "--head", "0.1"],
        "train-lens": ["train-lens", "--model", model_dir, "--data", data_dir, "--out", str(tmp_path / "lens"), "--steps", "2",
                       "--tokens-per-step", "64", "--ctx", "16", "--quiet"],
        "eval-lens": ["eval-lens", "--model", model_dir, "--lens", "logit", "--data", data_dir, "--tokens", "64", "--ctx", "16",
                      "--quiet"],
        "cache": ["cache", "--model", model_dir, "--data", data_dir, "--hooks", "resid_post.0", "--out", str(tmp_path / "acts"),
                  "--tokens", "64", "--ctx", "16", "--quiet"],
    }


@pytest.mark.parametrize("name", ["lens", "ablate", "train-lens", "eval-lens", "cache"])
@pytest.mark.parametrize("dtype, want", [("bf16", torch.bfloat16), ("auto", torch.float32)])
def test_each_command_runs_on_cuda(name, dtype, want, folder, tmp_path, loads, capsys):
    from lenses.cli import main

    assert main([*cli_commands(folder, tmp_path)[name], "--device", "cuda", "--dtype", dtype]) == 0, capsys.readouterr().err
    assert loads == [(want, "cuda")]  # auto: the checkpoint's dtype on a GPU (the tiny model's config names none)


def test_the_default_device_is_cuda_and_said_once(folder, tmp_path, loads, capsys):
    from lenses.cli import main

    assert main(cli_commands(folder, tmp_path)["lens"]) == 0
    assert loads == [(torch.float32, "cuda")]
    assert "lenskit lens: device cuda (torch sees" in capsys.readouterr().err


def test_train_lens_autocast_on_cuda_is_recorded_and_computes_the_same_objective(folder, tmp_path, capsys):
    import json

    from lenses.cli import main

    argv = cli_commands(folder, tmp_path)["train-lens"]
    assert main([*argv, "--device", "cuda", "--autocast"]) == 0, capsys.readouterr().err
    config = json.loads((tmp_path / "lens" / "config.json").read_text())
    assert config["recipe"]["autocast"] is True and "| autocast | true |" in (tmp_path / "lens" / "README.md").read_text()
    mixed = config["loss_history"]
    assert main([*argv[:argv.index("--out") + 1], str(tmp_path / "fp32"), *argv[argv.index("--out") + 2:], "--device", "cuda"]) == 0
    full = json.loads((tmp_path / "fp32" / "config.json").read_text())["loss_history"]
    # Step 0 reads the untrained lens (the logit lens): the same KL in bf16 autocast as in fp32, up to bf16 rounding.
    assert mixed[0] == pytest.approx(full[0], rel=0.05) and mixed[0] != full[0]
    assert main([*argv, "--device", "cuda", "--steps", "3"]) == 2  # extending it without autocast is another run
    assert "autocast (saved true, now false) differ" in capsys.readouterr().err

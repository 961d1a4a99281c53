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
from lenskit.io.data import load_token_stream
from lenskit.intervene.interventions import Head, Mlp, ablation_hooks

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

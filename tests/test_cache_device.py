"""run_with_cache(cache_device=...): the offloaded cache. On the CPU it is the plain cache, bit for bit, and the
cache's protection against in-place edits holds with it (the CUDA side is in tests/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_family

from lenskit import HookedTransformer
from lenskit.observe.hooks import CacheRecording


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request) -> HookedTransformer:
    return HookedTransformer.from_hf(make_hf_family(request.param))


@pytest.fixture(scope="module")
def tokens(model) -> torch.Tensor:
    return torch.randint(0, model.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(0))


def test_cache_device_cpu_is_the_plain_cache_bit_for_bit(model, tokens):
    with torch.no_grad():
        logits, plain = model.run_with_cache(tokens)
        offloaded_logits, offloaded = model.run_with_cache(tokens, cache_device="cpu")
    assert torch.equal(offloaded_logits, logits) and list(offloaded) == list(plain)
    for name in plain:
        assert torch.equal(offloaded[name], plain[name]) and offloaded[name].device.type == "cpu", name
    with torch.no_grad():
        _, cast = model.run_with_cache(tokens, cache_device="cpu", dtype=torch.bfloat16)
    assert all(torch.equal(cast[n], plain[n].to(torch.bfloat16)) for n in plain if plain[n].is_floating_point())


def test_in_place_edits_never_reach_an_offloaded_entry(model, tokens):
    """resid_post of block 0 is resid_pre of block 1: zeroing the latter in place leaves the former as written."""
    def zero(x, hook):
        x.zero_()

    edit = [("blocks.1.hook_resid_pre", zero)]
    with torch.no_grad():
        _, clean = model.run_with_cache(tokens)
        logits, plain = model.run_with_cache(tokens, fwd_hooks=edit)
        offloaded_logits, offloaded = model.run_with_cache(tokens, fwd_hooks=edit, cache_device="cpu")
    assert torch.equal(offloaded["blocks.0.hook_resid_post"], clean["blocks.0.hook_resid_post"])
    assert not offloaded["blocks.1.hook_resid_pre"].any()
    assert torch.equal(offloaded_logits, logits)
    assert all(torch.equal(offloaded[n], plain[n]) for n in plain)


def test_a_hook_editing_a_kept_reference_is_refused_with_cache_device(model, tokens):
    kept = {}

    def keep(x, hook):
        kept["x"] = x

    def edit_later(x, hook):
        kept["x"].mul_(2)  # edits the tensor cached at blocks.0.hook_resid_post behind the copy's back

    hooks = [("blocks.0.hook_resid_post", keep), ("blocks.1.hook_resid_mid", edit_later)]
    with torch.no_grad(), pytest.raises(ValueError, match="edited in place after it was cached"):
        model.run_with_cache(tokens, fwd_hooks=hooks, cache_device="cpu")


def test_device_and_cache_device_must_agree(model, tokens):
    with pytest.raises(ValueError, match="both say where the cache goes"):
        model.run_with_cache(tokens, device="meta", cache_device="cpu")
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, device="cpu", cache_device="cpu")
    assert len(cache) > 0


def test_synchronise_without_offload_is_a_no_op():
    recording = CacheRecording("cpu")
    recording.synchronise()
    assert recording.store == {}

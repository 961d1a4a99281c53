"""ActivationCache: a read-only mapping with `cache["resid_post", 3]` shorthand and the lens-layer stack."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from lenskit import ActivationCache
from lenskit.observe.cache import hook_name


@pytest.fixture(scope="module")
def run(model):
    tokens = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.run_with_cache(tokens)


def test_mapping_behaviour(model, run):
    _, cache = run
    assert isinstance(cache, Mapping)
    names = list(cache.keys())
    assert len(cache) == len(names) > 0
    assert set(names) <= set(model.hook_dict)
    # Keys come in the order the forward pass wrote them.
    assert names.index("blocks.0.hook_resid_pre") < names.index("blocks.0.ln1.hook_scale") < names.index("blocks.0.attn.hook_q")
    assert names.index("blocks.0.hook_resid_post") < names.index("blocks.1.hook_resid_pre")
    assert "blocks.0.hook_resid_pre" in cache and "blocks.99.hook_resid_pre" not in cache
    assert ("resid_pre", 0) in cache and ("resid_pre", 99) not in cache and ("result", 0) not in cache
    assert dict(cache.items()).keys() == set(names)
    assert all(isinstance(v, torch.Tensor) for v in cache.values())
    assert cache.get("nope") is None
    assert f"{len(cache)} tensors" in repr(cache) and "n_layers=3" in repr(cache)


def test_shorthand_and_negative_layers(model, run):
    _, cache = run
    n = model.cfg.n_layers
    for short, full in [("resid_post", "hook_resid_post"), ("resid_pre", "hook_resid_pre"),
                        ("attn_out", "hook_attn_out"), ("mlp_out", "hook_mlp_out"), ("resid_mid", "hook_resid_mid"),
                        ("pattern", "attn.hook_pattern"), ("q", "attn.hook_q"), ("z", "attn.hook_z"),
                        ("pre", "mlp.hook_pre"), ("post", "mlp.hook_post"),
                        ("scale1", "ln1.hook_scale"), ("normalized2", "ln2.hook_normalized")]:
        for layer in range(n):
            assert cache[short, layer] is cache[f"blocks.{layer}.{full}"]
        assert cache[short, -1] is cache[f"blocks.{n - 1}.{full}"]
        assert cache[short, -n] is cache[f"blocks.0.{full}"]
    assert hook_name("resid_post", 2) == "blocks.2.hook_resid_post"
    assert hook_name("hook_embed") == "hook_embed"
    assert hook_name("resid_post", -1, n_layers=4) == "blocks.3.hook_resid_post"


def test_clear_key_errors(model, run):
    _, cache = run
    n = model.cfg.n_layers
    with pytest.raises(KeyError, match=r"blocks\.0\.hook_resid_pst.*did you mean 'blocks\.0\.hook_resid_post'"):
        cache["blocks.0.hook_resid_pst"]
    with pytest.raises(KeyError, match="unknown short hook name 'resid'.*resid_post"):
        cache["resid", 0]
    with pytest.raises(IndexError, match=f"layer {n} is out of range"):
        cache["resid_post", n]
    with pytest.raises(IndexError, match="out of range"):
        cache["resid_post", -n - 1]
    # The result hook is computed on request only, so the default cache lacks it, and says so.
    with pytest.raises(KeyError, match="hook_result' is not in this cache"):
        cache["result", 0]


def test_accumulated_resid(model, run):
    _, cache = run
    n = model.cfg.n_layers
    stack = cache.accumulated_resid()
    assert stack.shape == (n + 1, 2, 7, model.cfg.d_model)  # [layer, batch, pos, d_model]
    for layer in range(n):
        assert torch.equal(stack[layer], cache["resid_pre", layer])
    assert torch.equal(stack[n], cache["resid_post", n - 1])
    # The lens convention: stream l is what the model computes when stopped after l blocks.
    tokens = torch.randint(0, 101, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for layer in range(n + 1):
            assert (model(tokens, stop_at_layer=layer) - stack[layer]).abs().max() <= 1e-6

    mid = cache.accumulated_resid(incl_mid=True)
    assert mid.shape[0] == 2 * n + 1
    for layer in range(n):
        assert torch.equal(mid[2 * layer], cache["resid_pre", layer])
        assert torch.equal(mid[2 * layer + 1], cache["resid_mid", layer])
    assert torch.equal(mid[-1], stack[-1])


def test_accumulated_resid_needs_the_resid_hooks(model):
    tokens = torch.zeros(1, 3, dtype=torch.long)
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("resid_pre"))
    with pytest.raises(KeyError, match=r"accumulated_resid needs.*hook_resid_post"):
        cache.accumulated_resid()
    with pytest.raises(KeyError, match="resid_mid"):
        cache.accumulated_resid(incl_mid=True)


def test_to_returns_a_converted_copy(run):
    _, cache = run
    wide = cache.to(dtype=torch.float64)
    assert isinstance(wide, ActivationCache) and wide.n_layers == cache.n_layers
    assert list(wide) == list(cache)
    assert all(v.dtype == torch.float64 for v in wide.values())
    assert all(v.dtype == torch.float32 for v in cache.values())  # the original is unchanged
    assert torch.equal(wide["resid_post", 1], cache["resid_post", 1].double())
    assert wide.accumulated_resid().dtype == torch.float64
    meta = cache.to("meta")
    assert {v.device.type for v in meta.values()} == {"meta"}


def test_cache_is_read_only(run):
    _, cache = run
    with pytest.raises(TypeError):
        cache["hook_embed"] = torch.zeros(1)  # type: ignore[index]


def test_standalone_cache():
    store = {"blocks.0.hook_resid_pre": torch.zeros(1, 2, 3), "blocks.0.hook_resid_post": torch.ones(1, 2, 3)}
    cache = ActivationCache(store, n_layers=1)
    assert cache.accumulated_resid().tolist() == [torch.zeros(1, 2, 3).tolist(), torch.ones(1, 2, 3).tolist()]
    assert cache["resid_post", -1] is store["blocks.0.hook_resid_post"]

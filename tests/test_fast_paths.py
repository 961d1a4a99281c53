"""The fast paths keep the numbers: fused attention, copy-free caching, early stopping, cache casting.

Each fast path is checked against the slow path it replaces and against transformers; nothing here is timed
(benchmarks/bench.py measures speed).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_hf_gpt2
from fixtures import unchanged_copy
from golden import ATOL, hf_reference, max_diff
from references import resid_writes

from lenskit import HookedTransformer, Stream


def resid_names(model: HookedTransformer) -> list[str]:
    return resid_writes(model.cfg.n_layers)


def noop(x, hook):
    return None


@pytest.fixture(scope="module")
def pair():
    hf = make_hf_gpt2(n_layer=4, n_embd=32, n_head=4, vocab_size=101, n_positions=64, seed=5)
    return hf, HookedTransformer.from_hf(hf)


@pytest.fixture
def batch() -> torch.Tensor:
    return torch.randint(0, 101, (2, 23), generator=torch.Generator().manual_seed(11))


@pytest.fixture
def counters(monkeypatch) -> dict[str, int]:
    """Counts calls of the fused kernels (looked up through F at call time, so patching F sees them)."""
    calls = {"sdpa": 0, "layer_norm": 0}
    real_sdpa, real_ln = F.scaled_dot_product_attention, F.layer_norm

    def sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return real_sdpa(*args, **kwargs)

    def layer_norm(*args, **kwargs):
        calls["layer_norm"] += 1
        return real_ln(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(F, "layer_norm", layer_norm)
    return calls


# ------------------------------------------------------------ fused vs eager
def test_caching_residual_writes_keeps_the_fused_kernels(pair, batch, counters):
    _, model = pair
    with torch.no_grad():
        model.run_with_cache(batch, names_filter=resid_names(model) + [f"blocks.{i}.attn.hook_z" for i in range(4)])
    n = model.cfg.n_layers
    assert counters["sdpa"] == n  # z is the kernel's output: no need for the hand-written attention
    assert counters["layer_norm"] == 2 * n + 1  # ln1, ln2 per block and ln_final, all fused


@pytest.mark.parametrize("internal", ["hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern"])
def test_reading_attention_internals_keeps_the_fused_output_exactly(pair, batch, counters, internal):
    """Observing does not move the numbers: a read-only hook gets the eager path's value, the output stays the kernel's."""
    _, model = pair
    with torch.no_grad():
        fused = model(batch)
        observed, cache = model.run_with_cache(batch, names_filter=f"blocks.2.attn.{internal}")
    assert counters["sdpa"] == 2 * model.cfg.n_layers
    assert torch.equal(observed, fused)
    assert f"blocks.2.attn.{internal}" in cache


def first_key(x: torch.Tensor) -> torch.Tensor:
    """5 on the first key's column of scores or pattern [batch, head, query_pos, key_pos], 0 elsewhere: an edit."""
    bump = torch.zeros_like(x)
    bump[..., 0] = 5.0
    return bump


@pytest.mark.parametrize("internal", ["hook_attn_scores", "hook_pattern"])
def test_an_edit_of_the_scores_or_pattern_takes_the_eager_path(pair, batch, counters, internal):
    """A returned tensor, or a value changed in place, is an edit: that block computes its output from what the hooks
    left, on the eager path (a returned copy that changes nothing agrees with the kernel to rounding)."""
    _, model = pair
    name, n = f"blocks.2.attn.{internal}", model.cfg.n_layers
    with torch.no_grad():
        fused = model(batch)
        copied = model.run_with_hooks(batch, fwd_hooks=[(name, unchanged_copy)])
        assert counters["sdpa"] == n + n - 1  # block 2 alone went eager
        returned = model.run_with_hooks(batch, fwd_hooks=[(name, lambda x, hook: x + first_key(x))])
        in_place = model.run_with_hooks(batch, fwd_hooks=[(name, lambda x, hook: x.add_(first_key(x)))])
    assert counters["sdpa"] == n + 3 * (n - 1)
    assert max_diff(fused, copied) <= 1e-5
    assert torch.equal(in_place, returned) and max_diff(returned, fused) > 1e-3


def test_in_bf16_a_read_leaves_the_logits_bit_for_bit_and_an_edit_moves_them_a_little(pair, batch):
    """The rule in numbers: reading the pattern changes nothing; an edit takes the eager path, within 2e-2 of the
    fused logits in bf16 (the two paths round differently; the review measured about 3e-3)."""
    hf, _ = pair
    model = HookedTransformer.from_hf(hf).to(torch.bfloat16)
    names = lambda n: n.endswith("attn.hook_pattern")  # noqa: E731
    with torch.no_grad():
        fused = model(batch)
        read = model.run_with_hooks(batch, fwd_hooks=[(names, lambda x, hook: None)])
        edited = model.run_with_hooks(batch, fwd_hooks=[(names, unchanged_copy)])
    assert torch.equal(read, fused)
    assert max_diff(edited.float(), fused.float()) <= 2e-2


def test_fused_and_eager_paths_agree_with_each_other_and_transformers(pair, batch, counters):
    hf, model = pair
    ref_logits, ref = hf_reference(hf, batch)
    counters["sdpa"] = 0  # count lenskit's calls only
    everywhere = [(lambda n: n.endswith("attn.hook_pattern"), unchanged_copy)]
    with torch.no_grad():
        fused_logits, fused = model.run_with_cache(batch, names_filter=resid_names(model))
        assert counters["sdpa"] == model.cfg.n_layers
        eager_logits, eager = model.run_with_cache(batch, names_filter=resid_names(model), fwd_hooks=everywhere)
        assert counters["sdpa"] == model.cfg.n_layers  # the second run never called the fused kernel
    assert max_diff(fused_logits, eager_logits) <= 1e-5
    for name in resid_names(model):
        assert max_diff(fused[name], eager[name]) <= 1e-5, name
    for name, want in ref.items():
        assert max_diff(fused[name], want) <= ATOL, name
        assert max_diff(eager[name], want) <= ATOL, name
    assert max_diff(fused_logits, ref_logits) <= ATOL
    assert max_diff(eager_logits, ref_logits) <= ATOL


# --------------------------------------------------------------- no copies
def test_cache_holds_the_very_tensors_the_forward_passed_on(pair, batch):
    _, model = pair
    seen: dict[str, int] = {}
    handles = []
    for i, block in enumerate(model.blocks):  # what the next op received, read with plain torch hooks
        handles.append(block.ln1.register_forward_pre_hook(
            lambda mod, args, i=i: seen.__setitem__(Stream(i, "resid_pre").hook_name(model.cfg.n_layers), args[0].data_ptr())))
        handles.append(block.ln2.register_forward_pre_hook(
            lambda mod, args, i=i: seen.__setitem__(Stream(i, "resid_mid").hook_name(model.cfg.n_layers), args[0].data_ptr())))
        handles.append(block.attn.register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(Stream(i, "attn_out").hook_name(model.cfg.n_layers), out.data_ptr())))
        handles.append(block.mlp.register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(Stream(i, "mlp_out").hook_name(model.cfg.n_layers), out.data_ptr())))
    handles.append(model.ln_final.register_forward_pre_hook(
        lambda mod, args: seen.__setitem__(Stream(model.cfg.n_layers).hook_name(model.cfg.n_layers), args[0].data_ptr())))
    try:
        with torch.no_grad():
            _, cache = model.run_with_cache(batch, names_filter=resid_names(model))
    finally:
        for h in handles:
            h.remove()
    assert len(seen) == 4 * model.cfg.n_layers + 1
    for name, ptr in seen.items():
        assert cache[name].data_ptr() == ptr, f"{name} was copied"
    for i in range(model.cfg.n_layers - 1):  # one stream tensor, two names, one storage
        assert cache["resid_post", i].data_ptr() == cache["resid_pre", i + 1].data_ptr()
    distinct = {t.untyped_storage().data_ptr() for t in cache.values()}
    assert len(distinct) == 4 * model.cfg.n_layers + 1


def test_a_cast_to_the_same_dtype_and_device_copies_nothing(pair, batch):
    _, model = pair
    with torch.no_grad():
        _, plain = model.run_with_cache(batch, names_filter=resid_names(model))
        _, same = model.run_with_cache(batch, names_filter=resid_names(model), device="cpu", dtype=torch.float32)
    distinct = {t.untyped_storage().data_ptr() for t in same.values()}
    assert len(distinct) == 4 * model.cfg.n_layers + 1
    assert all(torch.equal(plain[n], same[n]) for n in plain)


# ------------------------------------------------------- caching to a dtype
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 0.0), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_cache_straight_to_a_dtype(pair, batch, dtype, tol):
    _, model = pair
    names = resid_names(model)
    with torch.no_grad():
        ref_logits, ref = model.run_with_cache(batch, names_filter=names)
        logits, cache = model.run_with_cache(batch, names_filter=names, device=torch.device("cpu"), dtype=dtype)
    assert torch.equal(logits, ref_logits)  # the forward itself stays in fp32
    for n in names:
        assert cache[n].dtype == dtype and cache[n].device.type == "cpu"
        assert cache[n].data_ptr() != ref[n].data_ptr()
        scale = max(1.0, ref[n].abs().max().item())
        assert max_diff(cache[n], ref[n]) <= tol * scale, n
    # a cast cache is a copy per name: the shared stream tensor becomes two equal copies
    assert torch.equal(cache["resid_post", 0], cache["resid_pre", 1])


def test_a_cache_to_the_meta_device_is_refused(pair, batch):
    """The meta device keeps shapes and no values: a cache there would be empty (issue 40)."""
    _, model = pair
    with torch.no_grad(), pytest.raises(ValueError, match="device='meta': the meta device holds shapes and no values"):
        model.run_with_cache(batch, names_filter=resid_names(model), device="meta")


# ------------------------------------------------ early stopping from names
def count_blocks(model: HookedTransformer) -> tuple[list[int], list]:
    ran: list[int] = []
    handles = [b.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, b in enumerate(model.blocks)]
    handles.append(model.unembed.register_forward_hook(lambda m, a, o: ran.append(-1)))
    return ran, handles


@pytest.mark.parametrize("names, blocks_run", [
    (["blocks.1.hook_resid_post"], 2),
    (["blocks.0.hook_resid_pre", "blocks.2.hook_attn_out"], 3),
    (["blocks.3.hook_mlp_out"], 4),
    (["hook_embed", "hook_pos_embed"], 0),
    (["blocks.0.attn.hook_pattern"], 1),
])
def test_return_logits_false_runs_only_the_blocks_it_needs(pair, batch, names, blocks_run):
    hf, model = pair
    _, ref = hf_reference(hf, batch)
    with torch.no_grad():
        _, full = model.run_with_cache(batch, names_filter=names)
    ran, handles = count_blocks(model)
    try:
        with torch.no_grad():
            logits, cache = model.run_with_cache(batch, names_filter=names, return_logits=False)
    finally:
        for h in handles:
            h.remove()
    assert logits is None  # never a stream passed off as logits
    assert ran == list(range(blocks_run))  # and no unembedding (-1)
    assert sorted(cache) == sorted(names)
    for n in names:
        assert torch.equal(cache[n], full[n]), n
        if n in ref:
            assert max_diff(cache[n], ref[n]) <= ATOL, n


def test_return_logits_false_still_runs_everything_it_must(pair, batch):
    _, model = pair
    seen = []
    ran, handles = count_blocks(model)
    try:
        with torch.no_grad():
            # ln_final lives after the blocks: the whole model runs, the logits are dropped
            logits, cache = model.run_with_cache(batch, names_filter="ln_final.hook_normalized", return_logits=False)
            assert logits is None and ran == [0, 1, 2, 3, -1]
            ran.clear()
            # a fwd_hook deeper than any cached name extends the run, so its side effects happen
            _, cache = model.run_with_cache(batch, names_filter=["blocks.0.hook_resid_post"], return_logits=False,
                                            fwd_hooks=[("blocks.2.hook_mlp_out", lambda x, hook: seen.append(hook.name))])
            assert ran == [0, 1, 2] and seen == ["blocks.2.hook_mlp_out"]
            ran.clear()
            _, cache = model.run_with_cache(batch, names_filter=lambda n: n.startswith("blocks.1."), return_logits=False,
                                            fwd_hooks=[(lambda n: n == "blocks.2.hook_resid_pre", noop)])
            assert ran == [0, 1, 2] and all(n.startswith("blocks.1.") for n in cache)
    finally:
        for h in handles:
            h.remove()
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())


def test_return_logits_false_keeps_fwd_hook_edits(pair, batch):
    _, model = pair
    zero = [("blocks.0.hook_attn_out", lambda x, hook: torch.zeros_like(x))]
    with torch.no_grad():
        _, full = model.run_with_cache(batch, names_filter="blocks.1.hook_resid_mid", fwd_hooks=zero)
        _, short = model.run_with_cache(batch, names_filter="blocks.1.hook_resid_mid", fwd_hooks=zero,
                                        return_logits=False)
    assert torch.equal(full["resid_mid", 1], short["resid_mid", 1])


def test_stop_at_layer_and_the_cache(pair, batch):
    _, model = pair
    with torch.no_grad():
        stream, cache = model.run_with_cache(batch, names_filter=["blocks.1.hook_resid_post"], stop_at_layer=2)
        _, full = model.run_with_cache(batch, names_filter=["blocks.1.hook_resid_post"])
        assert torch.equal(stream, full["resid_post", 1]) and torch.equal(cache["resid_post", 1], stream)
        # a predicate takes what the shortened run produced
        _, some = model.run_with_cache(batch, names_filter=lambda n: n.endswith("hook_resid_post"), stop_at_layer=-2)
        assert sorted(some) == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
        # names asked for by name must all arrive
        with pytest.raises(ValueError, match="ends the run before"):
            model.run_with_cache(batch, names_filter=["blocks.2.hook_resid_pre", "blocks.2.hook_attn_out"],
                                 stop_at_layer=2)
        with pytest.raises(ValueError, match="not both"):
            model.run_with_cache(batch, names_filter="blocks.0.hook_resid_post", stop_at_layer=1, return_logits=False)
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())

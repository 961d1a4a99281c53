"""Hooks belong to the calling thread: concurrent runs on one model never see each other's hooks."""

from __future__ import annotations

import threading

import pytest
import torch

from lenskit.intervene.interventions import Block, ablation_hooks

ITERATIONS = 50
NAMES = ["blocks.0.hook_resid_post", "blocks.2.hook_attn_out", "blocks.1.hook_mlp_out"]


def run_threads(*bodies):
    """Start every body at once (a barrier lines them up), join them, re-raise the first error."""
    barrier = threading.Barrier(len(bodies))
    errors: list[BaseException] = []

    def wrap(body):
        def target():
            try:
                barrier.wait()
                body()
            except BaseException as e:  # noqa: BLE001 - reported in the main thread
                errors.append(e)
        return target

    threads = [threading.Thread(target=wrap(b)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]


@torch.no_grad()
def test_ablating_and_caching_threads_match_serial_runs(model, tokens):
    other = torch.randint(0, 101, (3, 17), generator=torch.Generator().manual_seed(2))
    ablate = ablation_hooks(model, [Block(1)], mode="zero")
    serial_ablated = model.run_with_hooks(tokens, fwd_hooks=ablate)
    serial_logits, serial_cache = model.run_with_cache(other, names_filter=NAMES)
    serial_plain = model(tokens)
    assert not torch.equal(serial_ablated, serial_plain)  # the ablation does change the output

    ablated, cached, plain = [], [], []

    def ablating():
        for _ in range(ITERATIONS):
            ablated.append(model.run_with_hooks(tokens, fwd_hooks=ablate))

    def caching():
        for _ in range(ITERATIONS):
            cached.append(model.run_with_cache(other, names_filter=NAMES))

    def plain_forward():
        for _ in range(ITERATIONS):
            plain.append(model(tokens))

    run_threads(ablating, caching, plain_forward)
    assert len(ablated) == len(cached) == len(plain) == ITERATIONS
    for out in ablated:
        assert torch.equal(out, serial_ablated)
    for out in plain:
        assert torch.equal(out, serial_plain)
    for logits, cache in cached:
        assert torch.equal(logits, serial_logits)
        assert sorted(cache.keys()) == sorted(NAMES)
        for name in NAMES:
            assert torch.equal(cache[name], serial_cache[name])


@torch.no_grad()
def test_two_concurrent_caches_keep_their_own_activations(model):
    a = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(3))
    b = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(4))
    names_a, names_b = ["blocks.0.hook_resid_pre", "blocks.2.attn.hook_pattern"], ["blocks.1.hook_resid_mid"]
    _, want_a = model.run_with_cache(a, names_filter=names_a)
    _, want_b = model.run_with_cache(b, names_filter=names_b)
    got_a, got_b = [], []
    run_threads(lambda: [got_a.append(model.run_with_cache(a, names_filter=names_a)[1]) for _ in range(ITERATIONS)],
                lambda: [got_b.append(model.run_with_cache(b, names_filter=names_b)[1]) for _ in range(ITERATIONS)])
    for cache in got_a:
        assert sorted(cache.keys()) == sorted(names_a)
        assert all(torch.equal(cache[n], want_a[n]) for n in names_a)
    for cache in got_b:
        assert sorted(cache.keys()) == sorted(names_b)
        assert torch.equal(cache[names_b[0]], want_b[names_b[0]])


@torch.no_grad()
def test_context_hooks_are_invisible_to_another_thread(model, tokens):
    seen: list[bool] = []
    entered, checked = threading.Event(), threading.Event()

    def holder():
        with model.hooks([("blocks.0.hook_resid_post", lambda x, hook: x * 0)]):
            assert model.hook_dict["blocks.0.hook_resid_post"].has_hooks()
            entered.set()
            checked.wait(timeout=60)

    def watcher():
        entered.wait(timeout=60)
        seen.append(model.hook_dict["blocks.0.hook_resid_post"].has_hooks())
        checked.set()

    run_threads(holder, watcher)
    assert seen == [False]
    assert not model.hook_dict["blocks.0.hook_resid_post"].has_hooks()


@torch.no_grad()
def test_add_hook_is_global_and_reset_hooks_clears_it(model, tokens):
    hp = model.hook_dict["blocks.0.hook_resid_post"]
    remove = hp.add_hook(lambda x, hook: x * 0)
    try:
        seen = []
        run_threads(lambda: seen.append(hp.has_hooks()))
        assert seen == [True]
        with model.hooks([("blocks.1.hook_resid_post", lambda x, hook: None)]):
            model.reset_hooks()
            assert not hp.has_hooks()
            assert not model.hook_dict["blocks.1.hook_resid_post"].has_hooks()
        assert not hp.has_hooks()
    finally:
        remove()


@torch.no_grad()
def test_nested_hooks_compose_and_unwind(model, tokens):
    name = "blocks.0.hook_resid_post"
    calls = []
    with model.hooks([(name, lambda x, hook: calls.append("outer"))]):
        with model.hooks([(name, lambda x, hook: calls.append("inner"))]):
            model(tokens)
        assert calls == ["outer", "inner"]
        model(tokens)
        assert calls == ["outer", "inner", "outer"]
    assert not model.hook_dict[name].has_hooks()


def test_hook_returning_another_dtype_names_hook_and_dtypes(model, tokens):
    def to_half(x, hook):
        return x.to(torch.float16)

    with pytest.raises(TypeError, match=r"to_half.*blocks\.0\.hook_resid_post.*float16.*float32"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", to_half)])
    assert not model.hook_dict["blocks.0.hook_resid_post"].has_hooks()


@torch.no_grad()
def test_concurrent_trajectories_match_serial_ones(model):
    from lenses import LogitLens, Trajectory

    lens = LogitLens(model)
    prompts = [torch.randint(0, 101, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 11)]
    want = [Trajectory.from_prompt(lens, p) for p in prompts]
    got: list[list] = [[], []]
    run_threads(*[lambda i=i: [got[i].append(Trajectory.from_prompt(lens, prompts[i])) for _ in range(10)]
                  for i in range(2)])
    for i in range(2):
        assert len(got[i]) == 10
        for traj in got[i]:
            assert torch.equal(traj.top_ids, want[i].top_ids)
            assert torch.equal(traj.kl_to_final, want[i].kl_to_final)

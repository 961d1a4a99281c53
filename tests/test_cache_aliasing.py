"""The cache holds what was written: a hook's in-place edit never reaches an entry cached at an earlier point.

Some points share one tensor: `resid_post` of block l is `resid_pre` of block l + 1, in rotary families
`hook_embed` is block 0's `resid_pre`, and where a norm follows a sublayer (Gemma, OLMo 2) that norm's
`hook_normalized` is the write `hook_attn_out` / `hook_mlp_out` sees. The reference for an in-place hook is the
same edit made out of place (on a copy, returned): both must give the same cache, entry by entry, and the same
logits. Without hooks that see cached tensors, caching copies nothing: the aten ops of `run_with_cache` are
those of a hand-written dictionary of hooks.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import make_hf_gpt2
from families import family_model_of
from fixtures import random_tokens
from torch.utils._python_dispatch import TorchDispatchMode

from lenskit import HookedTransformer

# Learned positions, rotary, parallel blocks with partial rotary, post-norm, sandwich norms with a scaled embedding.
FAMILIES = ["gpt2", "llama", "gpt_neox", "olmo2", "gemma2"]
ROTARY = [f for f in FAMILIES if f != "gpt2"]


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return random_tokens(2, 7, seed=3, high=300, low=3)


def set_pos(x: torch.Tensor) -> None:
    x[:, 2] = 0.5


def zero(x: torch.Tensor) -> None:
    x.zero_()


def double(x: torch.Tensor) -> None:
    x.mul_(2)


def add_one(x: torch.Tensor) -> None:
    x += 1


EDITS = {"x[:, 2] = 0.5": set_pos, "x.zero_()": zero, "x.mul_(2)": double, "x += 1": add_one}


def in_place(edit):
    def hook(x, hook):
        edit(x)  # returns None: the edit is the hook's only effect
    return hook


def on_a_copy(edit):
    def hook(x, hook):
        x = x.clone()
        edit(x)
        return x
    return hook


def assert_same_cache(got, want) -> None:
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs"


# Points whose input is a tensor the cache already holds, by family.
ALIASED = {
    "resid_pre 1": lambda cfg: "blocks.1.hook_resid_pre",  # is resid_post 0
    "resid_pre 0": lambda cfg: "blocks.0.hook_resid_pre",  # is hook_embed in rotary families
    "attn_out 1": lambda cfg: "blocks.1.hook_attn_out",  # is ln1_post.hook_normalized after a post-sublayer norm
    "mlp_out 0": lambda cfg: "blocks.0.hook_mlp_out",
    "resid_post 2": lambda cfg: "blocks.2.hook_resid_post",  # the hook runs before the cache at its own point
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("point", list(ALIASED))
@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_in_place_gives_the_cache_of_the_same_edit_on_a_copy(family, point, edit, tokens):
    model = family_model_of(family).model
    name = ALIASED[point](model.cfg)
    with torch.no_grad():
        want_logits, want = model.run_with_cache(tokens, fwd_hooks=[(name, on_a_copy(EDITS[edit]))])
        got_logits, got = model.run_with_cache(tokens, fwd_hooks=[(name, in_place(EDITS[edit]))])
        _, clean = model.run_with_cache(tokens)
    assert_same_cache(got, want)
    assert torch.equal(got_logits, want_logits)  # and the edit still reached the forward
    assert not torch.equal(got[name], clean[name])  # the edit did happen


@pytest.mark.parametrize("family", FAMILIES)
def test_resid_post_is_resid_pre_of_the_next_block_until_a_hook_edits_it(family, tokens):
    model = family_model_of(family).model
    n = model.cfg.n_layers
    with torch.no_grad():
        _, clean = model.run_with_cache(tokens)
        _, edited = model.run_with_cache(tokens, fwd_hooks=[("blocks.1.hook_resid_pre", in_place(set_pos))])
    for layer in range(n - 1):  # one tensor, no copy, in a run without hooks
        assert clean["resid_post", layer].data_ptr() == clean["resid_pre", layer + 1].data_ptr()
    assert torch.equal(edited["resid_post", 0], clean["resid_post", 0])  # as written by block 0
    assert (edited["resid_pre", 1][:, 2] == 0.5).all()  # as the hook left it
    assert torch.equal(edited["resid_pre", 1][:, 3:], clean["resid_pre", 1][:, 3:])


@pytest.mark.parametrize("family", ROTARY)
def test_hook_embed_keeps_the_embedding_when_resid_pre_0_is_edited(family, tokens):
    model = family_model_of(family).model
    with torch.no_grad():
        _, clean = model.run_with_cache(tokens)
        _, edited = model.run_with_cache(tokens, fwd_hooks=[("blocks.0.hook_resid_pre", in_place(zero))])
    assert clean["hook_embed"].data_ptr() == clean["resid_pre", 0].data_ptr()  # the alias the test is about
    assert torch.equal(edited["hook_embed"], clean["hook_embed"])
    assert (edited["resid_pre", 0] == 0).all()


@pytest.mark.parametrize("family", ["olmo2", "gemma2"])
def test_a_post_sublayer_norm_keeps_its_output_when_the_write_is_edited(family, tokens):
    model = family_model_of(family).model
    with torch.no_grad():
        _, clean = model.run_with_cache(tokens)
        _, edited = model.run_with_cache(tokens, fwd_hooks=[("blocks.1.hook_attn_out", in_place(zero))])
    normed = "blocks.1.ln1_post.hook_normalized"
    assert clean[normed].data_ptr() == clean["attn_out", 1].data_ptr()
    assert torch.equal(edited[normed], clean[normed]) and (edited["attn_out", 1] == 0).all()


class OpCount(TorchDispatchMode):
    """Counts the aten ops that run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def by_hand(model: HookedTransformer, tokens: torch.Tensor, extra=()) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A cache the plain way: one dict-storing hook on every point run_with_cache caches, no copies."""
    store: dict[str, torch.Tensor] = {}

    def keep(x, hook):
        store[hook.name] = x.detach()

    with model.hooks([*extra, *((name, keep) for name in model.hook_names())]):
        return model(tokens), store


def reads(x, hook):
    x.norm()  # reads its input and leaves it alone


@pytest.mark.parametrize("family", FAMILIES)
def test_caching_copies_nothing_unless_a_hook_is_handed_a_cached_tensor(family, tokens):
    model = family_model_of(family).model
    with torch.no_grad():
        runs = {}
        for label, run in [
            ("cache", lambda: model.run_with_cache(tokens)),
            ("by hand", lambda: by_hand(model, tokens)),
            ("cache + reader", lambda: model.run_with_cache(tokens, fwd_hooks=[("blocks.1.mlp.hook_post", reads)])),
            ("by hand + reader", lambda: by_hand(model, tokens, [("blocks.1.mlp.hook_post", reads)])),
            ("cache + editor", lambda: model.run_with_cache(tokens, fwd_hooks=[("blocks.1.hook_resid_pre", in_place(zero))])),
            ("by hand + editor", lambda: by_hand(model, tokens, [("blocks.1.hook_resid_pre", in_place(zero))])),
        ]:
            with OpCount() as count:
                run()
            runs[label] = count.ops
    assert runs["cache"] == runs["by hand"]
    assert runs["cache + reader"] == runs["by hand + reader"]
    extra = runs["cache + editor"] - runs["by hand + editor"]
    assert extra == Counter({"clone": 1}) and not runs["by hand + editor"] - runs["cache + editor"]  # one copy, there


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_an_edit_through_a_kept_reference_is_refused(family, tokens):
    model = family_model_of(family).model
    kept = []

    def keep(x, hook):
        kept.append(x)

    def edit_kept(x, hook):
        kept[0].zero_()

    with torch.no_grad(), pytest.raises(ValueError, match=r"^blocks\.0\.hook_resid_mid was edited in place after it "
                                                          r"was cached.*x = x\.clone\(\)"):
        model.run_with_cache(tokens, fwd_hooks=[("blocks.0.hook_resid_mid", keep), ("blocks.1.hook_mlp_out", edit_kept)])


def test_hooks_from_an_outer_context_and_global_hooks_are_guarded_too(tokens):
    model = HookedTransformer.from_hf(make_hf_gpt2(seed=4))  # its own model: a global hook is attached below
    tokens = tokens % model.cfg.d_vocab
    with torch.no_grad():
        _, want = model.run_with_cache(tokens, fwd_hooks=[("blocks.1.hook_resid_pre", on_a_copy(set_pos)),
                                                          ("blocks.2.hook_resid_pre", on_a_copy(double))])
        with model.hooks([("blocks.1.hook_resid_pre", in_place(set_pos))]):
            model.add_hook("blocks.2.hook_resid_pre", in_place(double))
            try:
                _, got = model.run_with_cache(tokens)
            finally:
                model.reset_hooks()
    assert_same_cache(got, want)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_guard_holds_in_inference_mode_and_under_autograd(family, tokens):
    model = family_model_of(family).model
    with torch.no_grad():
        _, want = model.run_with_cache(tokens, fwd_hooks=[("blocks.1.hook_resid_pre", on_a_copy(zero))])
    with torch.inference_mode():
        _, frozen = model.run_with_cache(tokens, fwd_hooks=[("blocks.1.hook_resid_pre", in_place(zero))])
    assert_same_cache(frozen, want)
    logits, graded = model.run_with_cache(tokens, fwd_hooks=[("blocks.1.hook_resid_pre", in_place(zero))])
    logits.sum().backward()  # the copy is part of the graph, so autograd sees no overwritten input
    assert_same_cache(graded, want)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_cast_cache_holds_what_was_written_too(dtype, tokens):
    model = family_model_of("llama").model  # float32: casting to it is no copy, so the alias stays
    with torch.no_grad():
        _, clean = model.run_with_cache(tokens, dtype=dtype)
        _, edited = model.run_with_cache(tokens, dtype=dtype, fwd_hooks=[("blocks.1.hook_resid_pre", in_place(zero))])
    assert torch.equal(edited["resid_post", 0], clean["resid_post", 0]) and edited["resid_post", 0].dtype == dtype
    assert (edited["resid_pre", 1] == 0).all()

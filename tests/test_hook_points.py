"""`HookedRootModule` as TransformerLens's: a small SAE-like subclass of our own, built once on lenskit's classes and
once on TransformerLens 4.3's `HookedRootModule` / `HookPoint`, must behave the same under `setup()`, `run_with_cache`,
`run_with_hooks`, `hooks()`, global, permanent, prepended and levelled hooks, `ctx` and `reset_hooks`."""

from __future__ import annotations

import pytest
import torch
from references import transformer_lens_4_3
from torch import nn

from lenskit.transformer_lens.hook_points import HookedRootModule, HookPoint


def toy_sae_class(root: type, point: type) -> type:
    """An SAE-shaped module (encode, ReLU, decode) inside two blocks, written against `root` and `point`."""

    class Block(nn.Module):
        def __init__(self, d: int, k: int, seed: int) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.W_enc = nn.Parameter(torch.randn(d, k, generator=g))
            self.W_dec = nn.Parameter(torch.randn(k, d, generator=g))
            self.hook_sae_input = point()  # [batch, d]
            self.hook_sae_acts_pre = point()  # [batch, k]
            self.hook_sae_acts_post = point()  # [batch, k]
            self.hook_sae_recons = point()  # [batch, d]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.hook_sae_input(x)
            post = self.hook_sae_acts_post(torch.relu(self.hook_sae_acts_pre(x @ self.W_enc)))
            return self.hook_sae_recons(post @ self.W_dec)

    class ToySAE(root):
        def __init__(self, d: int = 6, k: int = 10) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(d, k, seed) for seed in range(2))
            self.hook_out = point()  # [batch, d]
            self.setup()

        def forward(self, x: torch.Tensor, return_loss: bool = False) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            x = self.hook_out(x)
            return x.pow(2).mean() if return_loss else x

    return ToySAE


@pytest.fixture(scope="module")
def pair():
    """(ours, theirs): the same toy SAE on lenskit's classes and on TransformerLens 4.3's."""
    transformer_lens_4_3()
    from transformer_lens.hook_points import HookPoint as TLHookPoint
    from transformer_lens.HookedRootModule import HookedRootModule as TLRoot

    return toy_sae_class(HookedRootModule, HookPoint)(), toy_sae_class(TLRoot, TLHookPoint)()


X = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))


def both(pair, fn):
    """fn applied to ours and to theirs, each reset before and after."""
    out = []
    for model in pair:
        model.reset_hooks(including_permanent=True)
        try:
            out.append(fn(model))
        finally:
            model.reset_hooks(including_permanent=True)
    return out


def test_setup_names_hook_points_and_modules_as_transformer_lens_does(pair):
    ours, theirs = pair
    assert list(ours.hook_dict) == list(theirs.hook_dict)
    assert list(ours.mod_dict) == list(theirs.mod_dict)
    assert "blocks.1.hook_sae_acts_post" in ours.hook_dict
    hp = ours.hook_dict["blocks.1.hook_sae_acts_post"]
    assert hp.name == "blocks.1.hook_sae_acts_post" and hp.layer() == 1
    assert list(ours.hook_points()) == list(ours.hook_dict.values())


@pytest.mark.parametrize("names_filter", [None, "blocks.0.hook_sae_acts_post", ["hook_out", "blocks.1.hook_sae_input"],
                                          lambda name: name.endswith("acts_pre")])
def test_run_with_cache_matches(pair, names_filter):
    (out_a, cache_a), (out_b, cache_b) = both(pair, lambda m: m.run_with_cache(X, names_filter=names_filter))
    torch.testing.assert_close(out_a, out_b)
    assert type(cache_a) is dict and list(cache_a) == list(cache_b)
    for name in cache_a:
        torch.testing.assert_close(cache_a[name], cache_b[name])
        assert not cache_a[name].requires_grad


def test_run_with_cache_remove_batch_dim_and_incl_bwd_match(pair):
    one = X[:1]
    (_, a), (_, b) = both(pair, lambda m: m.run_with_cache(one, remove_batch_dim=True))
    assert a["hook_out"].shape == b["hook_out"].shape == (6,)
    (loss_a, a), (loss_b, b) = both(pair, lambda m: m.run_with_cache(X, incl_bwd=True, return_loss=True))
    torch.testing.assert_close(loss_a, loss_b)
    assert sorted(a) == sorted(b) and "blocks.0.hook_sae_acts_post_grad" in a
    for name in a:
        torch.testing.assert_close(a[name], b[name])
    for model in pair:
        model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="batch of 1"):
        pair[0].run_with_cache(X, remove_batch_dim=True)


def test_run_with_hooks_edit_matches_and_is_temporary(pair):
    def kill_feature(acts, hook):
        acts = acts.clone()
        acts[:, 3] = 0
        return acts

    hooks = [("blocks.0.hook_sae_acts_post", kill_feature)]
    a, b = both(pair, lambda m: m.run_with_hooks(X, fwd_hooks=hooks))
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, pair[0](X))
    # by hand: block 0 with feature 3 zeroed, then block 1
    block0, block1 = pair[0].blocks
    post = torch.relu(X @ block0.W_enc)
    post[:, 3] = 0
    x = post @ block0.W_dec
    torch.testing.assert_close(a, torch.relu(x @ block1.W_enc) @ block1.W_dec)
    assert not any(hp.has_hooks() for hp in pair[0].hook_dict.values())


def run_order(model, prepend_second: bool) -> list[str]:
    calls = []
    model.add_hook("hook_out", lambda x, hook: calls.append("first"))
    model.add_hook("hook_out", lambda x, hook: calls.append("second"), prepend=prepend_second)
    model(X)
    return calls


@pytest.mark.parametrize("prepend", [False, True])
def test_prepend_orders_hooks_as_transformer_lens_does(pair, prepend):
    a, b = both(pair, lambda m: run_order(m, prepend))
    assert a == b == (["second", "first"] if prepend else ["first", "second"])


def permanence(model) -> list[int]:
    """How many calls a permanent and a plain hook see across resets."""
    calls = []
    model.add_perma_hook("blocks.0.hook_sae_input", lambda x, hook: calls.append("perma"))
    model.add_hook("blocks.0.hook_sae_input", lambda x, hook: calls.append("plain"))
    model(X)
    model.reset_hooks()
    model(X)
    with model.hooks(fwd_hooks=[("hook_out", lambda x, hook: calls.append("context"))]):
        model(X)
    model(X)
    model.reset_hooks(including_permanent=True)
    model(X)
    return calls


def test_permanent_hooks_survive_reset_hooks_as_in_transformer_lens(pair):
    a, b = both(pair, permanence)
    assert a == b == ["perma", "plain", "perma", "perma", "context", "perma"]


def levels(model) -> list[str]:
    calls = []
    with model.hooks(fwd_hooks=[("hook_out", lambda x, hook: calls.append("kept"))], reset_hooks_end=False):
        model(X)
    model(X)  # still there after the block
    model.add_hook("hook_out", lambda x, hook: calls.append("other level"), level=7)
    model(X)
    model.reset_hooks(level=7)  # removes only the hook attached at level 7
    model(X)
    model.reset_hooks()
    model(X)
    return calls


def test_hooks_left_after_the_block_and_levels_match(pair):
    a, b = both(pair, levels)
    assert a == b == ["kept", "kept", "kept", "other level", "kept"]


def directions(model) -> list[str]:
    calls = []
    model.add_hook("hook_out", lambda x, hook: calls.append("fwd"))
    model.add_hook("hook_out", lambda g, hook: calls.append("bwd"), dir="bwd")
    model.remove_all_hook_fns(direction="fwd")
    model(X, return_loss=True).backward()
    model.remove_all_hook_fns(direction="bwd")
    model(X, return_loss=True).backward()
    model.zero_grad(set_to_none=True)
    return calls


def test_remove_all_hook_fns_by_direction_matches(pair):
    a, b = both(pair, directions)
    assert a == b == ["bwd"]


def contexts(model, clear: bool) -> list[int]:
    def count(x, hook):
        hook.ctx["n"] = hook.ctx.get("n", 0) + 1

    seen = []
    for _ in range(2):
        model.run_with_hooks(X, fwd_hooks=[("hook_out", count)], clear_contexts=clear)
        seen.append(model.hook_dict["hook_out"].ctx.get("n", 0))
    model.reset_hooks(clear_contexts=False)
    seen.append(model.hook_dict["hook_out"].ctx.get("n", 0))
    model.reset_hooks()
    seen.append(model.hook_dict["hook_out"].ctx.get("n", 0))
    return seen


@pytest.mark.parametrize("clear", [False, True])
def test_ctx_is_kept_and_cleared_as_in_transformer_lens(pair, clear):
    a, b = both(pair, lambda m: contexts(m, clear))
    assert a == b == ([0, 0, 0, 0] if clear else [1, 2, 2, 0])


def test_hook_point_add_hook_handle_and_prepend():
    hp = HookPoint()
    calls = []
    first = hp.add_hook(lambda x, hook: calls.append(1))
    hp.add_hook(lambda x, hook: calls.append(0), prepend=True)
    hp(torch.zeros(1))
    assert calls == [0, 1] and len(hp.fwd_hooks) == 2
    first.hook.remove()  # TransformerLens's spelling
    hp(torch.zeros(1))
    assert calls == [0, 1, 0] and hp.has_hooks(dir="fwd") and not hp.has_hooks(dir="bwd")
    hp.add_perma_hook(lambda x, hook: None)
    assert hp.has_hooks(including_permanent=False)
    hp.remove_hooks()
    assert hp.has_hooks() and not hp.has_hooks(including_permanent=False)
    hp.remove_hooks("both", including_permanent=True)
    assert not hp.has_hooks()
    with pytest.raises(ValueError, match="'fwd', 'bwd' or 'both'"):
        hp.remove_hooks("sideways")


def test_hooks_are_removed_when_the_forward_raises():
    model = toy_sae_class(HookedRootModule, HookPoint)()

    def boom(x, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.run_with_hooks(X, fwd_hooks=[("hook_out", boom)])
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())
    with pytest.raises(ValueError, match="must be a scalar"):
        model.run_with_cache(X, incl_bwd=True)  # the output is [batch, d], not a loss
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())
    with pytest.raises(KeyError, match="unknown hook name 'hook_ot'"):
        model.run_with_hooks(X, fwd_hooks=[("hook_ot", boom)])
    assert model.context_level == 0


def test_the_hooked_transformer_keeps_permanent_hooks_and_takes_transformer_lens_arguments():
    from families import build_family_model

    model = build_family_model("gpt2").model
    tokens = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    clean = model(tokens)
    zero_head = lambda z, hook: torch.cat([z[:, :, :1] * 0, z[:, :, 1:]], dim=2)  # noqa: E731
    want = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", zero_head)], clear_contexts=True)
    calls = []
    try:
        model.add_perma_hook("blocks.0.attn.hook_z", zero_head)
        model.add_hook("blocks.0.attn.hook_z", lambda z, hook: calls.append("before"), prepend=True)
        torch.testing.assert_close(model(tokens), want)
        model.reset_hooks()
        assert calls == ["before"]
        torch.testing.assert_close(model(tokens), want)  # the permanent hook stayed
        _, cache = model.run_with_cache(tokens, names_filter="blocks.0.attn.hook_z")
        assert not cache["blocks.0.attn.hook_z"][:, :, 0].any()  # the cache sees the permanent edit
        with model.hooks([("blocks.1.hook_mlp_out", lambda x, hook: calls.append("kept"))], reset_hooks_end=False):
            pass
        model(tokens)
        assert calls == ["before", "kept"]
    finally:
        model.reset_hooks(including_permanent=True)
    torch.testing.assert_close(model(tokens), clean)
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())


def test_a_subclass_may_pass_its_config_up_as_with_transformer_lens():
    class WithConfig(HookedRootModule):
        def __init__(self, cfg: dict) -> None:
            super().__init__(cfg)  # TransformerLens's HookedRootModule takes and ignores arguments
            self.cfg = cfg
            self.hook_x = HookPoint()  # [batch, d]
            self.setup()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.hook_x(x) + 1

    module = WithConfig({"d": 3})
    out, cache = module.run_with_cache(torch.zeros(2, 3))
    assert list(cache) == ["hook_x"] and torch.equal(out, torch.ones(2, 3))

"""from_pretrained on every HF GPT-2 layout found in the wild (tests/gpt2_layouts.py), and saving. Bad checkpoints:
tests/test_loading_refusals.py.

Every layout is checked for golden parity against the transformers model that wrote it.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_hf_gpt2
from golden import ATOL, assert_golden, max_diff
from gpt2_layouts import LAYOUTS, layout_bare_tied, layout_sharded, tiny_gpt2

from lenskit import HookedTransformer


@pytest.fixture(scope="module")
def hf():
    return tiny_gpt2()


@pytest.fixture(scope="module")
def hf_untied():
    return make_hf_gpt2(n_layer=2, n_embd=24, n_head=3, vocab_size=71, n_positions=32, seed=12,
                        tie_word_embeddings=False)


@pytest.fixture
def batch():
    return torch.randint(0, 71, (2, 15), generator=torch.Generator().manual_seed(2))


# -------------------------------------------------------------- golden parity
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_loads_with_golden_parity(hf, tmp_path, layout, batch):
    folder = LAYOUTS[layout](hf, tmp_path / layout)
    model = HookedTransformer.from_pretrained(folder)
    assert model.cfg.n_layers == 3 and model.cfg.d_vocab == 101
    assert model.unembed.weight is model.embed.weight  # tied, whatever the file held
    assert not model.training
    assert_golden(model, hf, batch)
    # Eager attention (a hook on the pattern) gives the same numbers.
    assert_golden(model, hf, batch, fwd_hooks=[(lambda n: n.endswith("hook_pattern"), lambda x, h: None)])


@pytest.mark.parametrize("layout", ["prefixed+lm_head", "sharded"])
def test_untied_layouts_load_with_golden_parity(hf_untied, tmp_path, layout, batch):
    folder = LAYOUTS[layout](hf_untied, tmp_path / layout)
    model = HookedTransformer.from_pretrained(folder)
    assert not model.cfg.tie_word_embeddings
    assert model.unembed.weight is not model.embed.weight
    assert torch.equal(model.unembed.weight, hf_untied.lm_head.weight)
    assert_golden(model, hf_untied, batch)


def test_shard_count_does_not_matter(hf, tmp_path, batch):
    two = HookedTransformer.from_pretrained(layout_sharded(hf, tmp_path / "two", n_shards=2))
    three = HookedTransformer.from_pretrained(layout_sharded(hf, tmp_path / "three", n_shards=3))
    with torch.no_grad():
        assert torch.equal(two(batch), three(batch))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_is_honoured(hf, tmp_path, dtype, batch):
    model = HookedTransformer.from_pretrained(layout_bare_tied(hf, tmp_path / "m"), dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    with torch.no_grad():
        logits = model(batch)
        want = hf(batch).logits
    assert logits.dtype == dtype
    if dtype == torch.float64:
        assert max_diff(logits, want) <= ATOL
    else:  # bf16 keeps ~3 significant digits; the logits still track the fp32 reference
        assert max_diff(logits, want) <= 0.05 * want.abs().max().item()
        assert (logits.float().argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_device_is_honoured(hf, tmp_path):
    folder = layout_bare_tied(hf, tmp_path / "m")
    model = HookedTransformer.from_pretrained(folder, device=torch.device("cpu"))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.unembed.weight is model.embed.weight
    for where in ({"device": "meta"}, {"device_map": {"": "meta"}}):  # shapes and no values: a model without weights
        with pytest.raises(ValueError, match="the meta device holds shapes and no values"):
            HookedTransformer.from_pretrained(folder, **where)
    if torch.cuda.is_available():
        cuda = HookedTransformer.from_pretrained(folder, device="cuda")
        assert {p.device.type for p in cuda.parameters()} == {"cuda"}
        tokens = torch.randint(0, 101, (2, 9))
        with torch.no_grad():
            assert max_diff(cuda(tokens).cpu(), model(tokens)) <= ATOL


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_our_save_loads_in_transformers(hf, hf_untied, tmp_path, which, batch):
    source = hf if which == "tied" else hf_untied
    ours = HookedTransformer.from_hf(source)
    ours.save_pretrained(tmp_path / "saved")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"), attn_implementation="eager").eval()
    with torch.no_grad():
        assert max_diff(theirs(batch).logits, ours(batch)) <= ATOL
        assert max_diff(theirs(batch).logits, source(batch).logits) <= ATOL
    again = HookedTransformer.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(again(batch), ours(batch))
    assert again.cfg.replace(name="x") == ours.cfg.replace(name="x")


def test_from_hf_accepts_gpt2model(hf, batch):
    # A bare GPT2Model (no LM head) converts too; its logits come from the tied embedding.
    model = HookedTransformer.from_hf(hf.transformer)
    with torch.no_grad():
        assert max_diff(model(batch), hf(batch).logits) <= ATOL

"""Generation with the KV cache: the same tokens as without it on every family (ragged batches too), the same as
transformers' own cached greedy `generate`, and hooks that fire on every new position, so an ablation changes both
paths alike. TransformerLens's arguments (stop_at_eos, eos_token_id, return_type, verbose, freq_penalty,
padding_side) are in tests/test_generate_options.py.

The references are independent: generation without the cache (one full forward per token, exact), transformers'
`generate(do_sample=False)` with its own cache, and TransformerLens 4.3's bridge on the same checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from families import FAMILY_BUILDERS, build_family_model, family_model_of

TEXTS = ["a", "def add(a, b):", "import os\nprint('hello world')\n"]


def prompt(batch: int = 2, pos: int = 6, seed: int = 3) -> torch.Tensor:
    return torch.randint(1, 300, (batch, pos), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILY_BUILDERS))
def test_cached_greedy_generation_is_the_uncached_one(family):
    model = family_model_of(family).model
    for tokens in (prompt(), TEXTS):  # equal rows; a ragged batch of texts, each continuing its own text
        cached = model.generate(tokens, 10, stop_at_eos=False)
        uncached = model.generate(tokens, 10, stop_at_eos=False, use_past_kv_cache=False)
        assert torch.equal(cached, uncached), family


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_seeded_sampling_of_equal_rows_is_the_same_with_the_cache(family):
    model = family_model_of(family).model
    runs = [model.generate(prompt(3), 8, do_sample=True, temperature=1.5, generator=torch.Generator().manual_seed(5),
                           use_past_kv_cache=cached, stop_at_eos=False) for cached in (True, False)]
    assert torch.equal(*runs)


# gemma4: kv sharing; deepseek_v3: a cache of latents against transformers' cache of expanded keys and values;
# qwen3_next: the recurrent state of the fused-projection DeltaNet beside a shared expert
# llama4_text: chunks shorter than the prompt, against transformers' cache that keeps only the last chunk's keys
# falcon_h1: a KV cache and a Mamba-2 state in every block; glm4_moe: partial rotary and q/k norms over a cache;
# nemotron_h: Mamba-2 convolution inputs and states (and attention without positions); granitemoehybrid: Mamba-2
# states beside attention's keys and values, the muP scalars
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3_5_text", "gpt_oss", "gemma4_text", "deepseek_v3",
                                    "qwen3_next", "llama4_text", "falcon_h1", "glm4_moe", "nemotron_h",
                                    "granitemoehybrid"])
def test_cached_generation_is_transformers_cached_generate(family):
    pair = build_family_model(family)  # fresh: its generation config is changed below
    pair.hf.generation_config.eos_token_id = None  # run all 10 steps, as stop_at_eos=False does
    tokens = prompt(2, 7, seed=6)
    with torch.no_grad():
        want = pair.hf.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=10, do_sample=False,
                                use_cache=True, pad_token_id=0)
    assert torch.equal(pair.model.generate(tokens, 10, stop_at_eos=False), want), family


def test_a_cached_row_that_passes_n_ctx_slides_its_window_as_uncached():
    model = family_model_of("llama").model
    n_ctx = model.cfg.n_ctx
    tokens = prompt(2, n_ctx - 3)
    cached = model.generate(tokens, 6, stop_at_eos=False)
    assert cached.shape == (2, n_ctx + 3)
    assert torch.equal(cached, model.generate(tokens, 6, stop_at_eos=False, use_past_kv_cache=False))


@pytest.mark.parametrize("cached", [True, False])
def test_a_hook_around_generate_sees_every_step(cached):
    model = family_model_of("llama").model
    shapes = []
    with model.hooks([("blocks.1.hook_resid_post", lambda x, hook: shapes.append(tuple(x.shape[:2])))]):
        out = model.generate(prompt(2, 5), 4, stop_at_eos=False, use_past_kv_cache=cached)
    assert out.shape == (2, 9)
    if cached:  # the prompt, then each new token alone (the last one needs no forward)
        assert shapes == [(2, 5), (2, 1), (2, 1), (2, 1)]
    else:  # the whole sequence, one token longer each time
        assert shapes == [(2, 5), (2, 6), (2, 7), (2, 8)]
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())


@pytest.mark.parametrize("family", ["gpt2", "qwen3_5_text"])
def test_an_ablation_changes_generation_alike_with_and_without_the_cache(family):
    model = family_model_of(family).model
    tokens = prompt(2, 5)
    ablate = [("blocks.1.hook_attn_out", lambda x, hook: torch.zeros_like(x))]
    runs = []
    for cached in (True, False):
        with model.hooks(ablate):
            runs.append(model.generate(tokens, 8, stop_at_eos=False, use_past_kv_cache=cached))
    assert torch.equal(*runs)
    assert not torch.equal(runs[0], model.generate(tokens, 8, stop_at_eos=False))  # the ablation did something


@pytest.mark.slow
@pytest.mark.parametrize("cached", [True, False])
def test_transformer_lens_bridge_generates_the_same_text(cached):
    from tl_fixtures import boot_bridge, tiny_gpt2_folder

    import lenskit

    folder = tiny_gpt2_folder()
    bridge = boot_bridge(folder, fold_ln=False, center_writing_weights=False, center_unembed=False,
                         fold_value_biases=False)
    model = lenskit.HookedTransformer.from_pretrained(folder)
    text = "The quick brown fox"
    want = bridge.generate(text, max_new_tokens=12, do_sample=False, use_past_kv_cache=cached, verbose=False)
    got = model.generate(text, 12, use_past_kv_cache=cached, return_type="str", prepend_bos=True)
    assert isinstance(got, str) and got == want and got.startswith(text) and len(got) > len(text)

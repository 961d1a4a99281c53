"""SAELens 6.54 on lenskit's namespace, against hand computations from the SAE's own weights: splicing an SAE in,
caching its activations, the error term, and a short run of SAELens's training runner whose saved SAE loads back."""

import inspect
import json
import os
import sys

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens", reason="runs in the ecosystem environment (scripts/ecosystem_env.sh)")
datasets = pytest.importorskip("datasets")

import lenskit  # noqa: E402
import lenskit.transformer_lens as tl  # noqa: E402
from sae_lens import (HookedSAETransformer, LanguageModelSAERunnerConfig, LanguageModelSAETrainingRunner,  # noqa: E402
                      LoggingConfig, SAE, StandardSAE, StandardSAEConfig, StandardTrainingSAE,
                      StandardTrainingSAEConfig)

HOOK = "blocks.1.hook_resid_pre"
TEXT = "def mean(xs):\n    return sum(xs) / len(xs)\n"


def test_saelens_imports_the_namespace():
    assert sys.modules["transformer_lens"] is tl
    from sae_lens.analysis import hooked_sae_transformer

    assert hooked_sae_transformer.HookedTransformer is tl.HookedTransformer


@pytest.fixture(scope="module")
def model():
    return HookedSAETransformer.from_pretrained(lenskit.DEFAULT_MODEL, device="cpu").eval()


@pytest.fixture(scope="module")
def sae(model):
    cfg = StandardSAEConfig(d_in=model.cfg.d_model, d_sae=96)
    cfg.metadata.hook_name = HOOK
    torch.manual_seed(0)
    sae = StandardSAE(cfg)
    with torch.no_grad():
        for p in sae.parameters():
            p.normal_(std=0.1)
    return sae


def by_hand(sae, x):
    """(latents, reconstruction) of a standard SAE from its weights: relu((x - b_dec) W_enc + b_enc) W_dec + b_dec."""
    acts = torch.relu((x - sae.b_dec) @ sae.W_enc + sae.b_enc)
    return acts, acts @ sae.W_dec + sae.b_dec


def test_run_with_saes_is_a_hand_splice(model, sae):
    tokens = model.to_tokens(TEXT)
    spliced = model.run_with_hooks(tokens, fwd_hooks=[(HOOK, lambda x, hook: by_hand(sae, x)[1])])
    with torch.no_grad():
        got = model.run_with_saes(tokens, saes=[sae])
    torch.testing.assert_close(got, spliced, rtol=1e-5, atol=1e-5)
    assert (got - model(tokens)).abs().max() > 1e-2  # the splice changed the logits: it ran
    assert model.acts_to_saes == {}  # run_with_saes leaves nothing attached


def test_cache_with_saes_holds_the_hand_latents(model, sae):
    tokens = model.to_tokens(TEXT)
    _, clean = model.run_with_cache(tokens, names_filter=HOOK)
    with torch.no_grad():
        _, cache = model.run_with_cache_with_saes(tokens, saes=[sae])
    acts, recons = by_hand(sae, clean[HOOK])
    torch.testing.assert_close(cache[f"{HOOK}.hook_sae_input"], clean[HOOK])
    torch.testing.assert_close(cache[f"{HOOK}.hook_sae_acts_post"], acts, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[f"{HOOK}.hook_sae_recons"], recons, rtol=1e-5, atol=1e-5)


def test_error_term_leaves_the_logits_clean(model, sae):
    tokens = model.to_tokens(TEXT)
    sae.use_error_term = True
    try:
        with torch.no_grad():
            got = model.run_with_saes(tokens, saes=[sae])
    finally:
        sae.use_error_term = False
    torch.testing.assert_close(got, model(tokens), rtol=1e-4, atol=1e-4)


def token_rows(model, ctx):
    ids = model.tokenizer(inspect.getsource(json) + inspect.getsource(os))["input_ids"]
    return [ids[i:i + ctx] for i in range(0, len(ids) - ctx, ctx)]


def explained_variance(sae, x):
    recons = by_hand(sae, x)[1]
    return 1 - ((x - recons) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()


def test_training_runner_trains_and_its_saved_sae_loads(tmp_path):
    model = tl.HookedTransformer.from_pretrained(lenskit.DEFAULT_MODEL, device="cpu")
    ctx = 32
    rows = token_rows(model, ctx)
    train, held_out = rows[:-8], rows[-8:]
    sae_cfg = StandardTrainingSAEConfig(d_in=model.cfg.d_model, d_sae=128, l1_coefficient=1.0)
    cfg = LanguageModelSAERunnerConfig(
        sae=sae_cfg, model_name=lenskit.DEFAULT_MODEL, hook_name=HOOK, dataset_path="(override_dataset)",
        is_dataset_tokenized=True, streaming=False, context_size=ctx, training_tokens=ctx * 64,
        train_batch_size_tokens=64, store_batch_size_prompts=4, n_batches_in_buffer=4, device="cpu",
        logger=LoggingConfig(log_to_wandb=False), output_path=str(tmp_path / "sae"), checkpoint_path=None,
        n_batches_for_norm_estimate=2, prepend_bos=False, verbose=False, seed=0)
    trained = LanguageModelSAETrainingRunner(cfg, override_dataset=datasets.Dataset.from_dict({"tokens": train})).run()

    saved = SAE.load_from_disk(str(tmp_path / "sae"), device="cpu")
    assert {"cfg.json", "sae_weights.safetensors"} <= set(os.listdir(tmp_path / "sae"))
    assert saved.cfg.metadata.hook_name == HOOK
    for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
        torch.testing.assert_close(getattr(saved, name), getattr(trained, name))

    _, cache = model.run_with_cache(torch.tensor(held_out), names_filter=HOOK)
    x = cache[HOOK].reshape(-1, model.cfg.d_model)  # [token, d_model], tokens the run never saw
    torch.manual_seed(0)
    untrained = StandardTrainingSAE(sae_cfg)
    with torch.no_grad():
        assert explained_variance(saved, x) > explained_variance(untrained, x) + 0.1
        torch.testing.assert_close(saved.encode(x), by_hand(saved, x)[0], rtol=1e-4, atol=1e-5)

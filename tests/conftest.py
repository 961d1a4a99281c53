"""Shared fixtures: small random GPT-2s built with `transformers`, so no test needs a download."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import transformers

import lenskit

transformers.logging.set_verbosity_error()
torch.set_num_threads(1)  # the CI machine has 2 cores; tests also run beside other work

ROOT = Path(__file__).resolve().parents[1]


def checkout_status() -> str | None:
    """`git status --porcelain` of the repository (every untracked file listed), or None outside a git checkout."""
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STATUS] = checkout_status()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Tests never write into the checkout: the suite fails if `git status` changed while it ran."""
    before, after = session.config.stash.get(_STATUS, None), checkout_status()
    if before is None or after is None or before == after:
        return
    changed = sorted(set(after.splitlines()) ^ set(before.splitlines()))
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("the tests changed the checkout (git status differs; write to tmp_path instead): "
                            + "; ".join(changed[:20]), red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


_STATUS = pytest.StashKey[str | None]()


def make_hf_gpt2(n_layer: int = 3, n_embd: int = 32, n_head: int = 4, vocab_size: int = 101, n_positions: int = 64,
                 seed: int = 0, **kwargs) -> transformers.GPT2LMHeadModel:
    """A random fp32 GPT2LMHeadModel in eval mode, with LayerNorm gains and biases moved away from 1 and 0
    so that a wrong norm implementation cannot hide behind the identity."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, n_positions=n_positions,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager", **kwargs,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or "ln_f" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.05)
    return model


def _perturb(model: torch.nn.Module) -> None:
    """Norm gains away from 1 and biases away from 0, so a wrong norm or a dropped bias cannot hide."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name or "ln_f" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.05)


# Tiny configs, one per family, each exercising what makes the family itself: partial rotary and the
# parallel block (gpt_neox), GQA and llama3 rotary scaling (llama), a sliding window shorter than the
# test prompts (mistral), q/k/v biases (qwen2), q/k norms and a d_head that is not d_model / n_heads (qwen3).
_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, vocab_size=101,
              max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
FAMILY_CONFIGS = {
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        _SHAPE, rotary_pct=0.5, rotary_emb_base=1000.0, use_parallel_residual=True, hidden_act="gelu",
        hidden_dropout=0.0, attention_dropout=0.0, layer_norm_eps=1e-5)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        _SHAPE, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_SHAPE, num_key_value_heads=2, sliding_window=5, head_dim=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_SHAPE, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_SHAPE, num_key_value_heads=2, head_dim=16)),
    # Gemma: weights 10x larger than usual so that soft-caps this small bite (test_families checks they do), a
    # query_pre_attn_scalar that is not d_head, one sliding block (window shorter than the prompt) and one global.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        _SHAPE, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=5, initializer_range=0.2,
        attn_logit_softcapping=1.0, final_logit_softcapping=2.0, pad_token_id=0)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        _SHAPE, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=5, initializer_range=0.2,
        final_logit_softcapping=2.0, pad_token_id=0, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=100.0),
                         "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=10000.0)})),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_SHAPE, num_key_value_heads=2, pad_token_id=0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        _SHAPE, num_key_value_heads=2, sliding_window=6, pad_token_id=0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
}
FAMILIES = ["gpt2", *FAMILY_CONFIGS]


def make_hf_family(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random fp32 transformers causal LM of `family`, eager attention, eval mode, perturbed norms."""
    if family == "gpt2":
        return make_hf_gpt2(seed=seed, **overrides)
    config_cls, model_cls, kwargs = FAMILY_CONFIGS[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**kwargs, **overrides}, attn_implementation="eager")
    model = getattr(transformers, model_cls)(cfg).eval()
    _perturb(model)
    return model


@pytest.fixture(scope="session")
def hf_model() -> transformers.GPT2LMHeadModel:
    return make_hf_gpt2()


@pytest.fixture(scope="session")
def model(request, hf_model) -> lenskit.HookedTransformer:
    """The 3-layer GPT-2 of `hf_model`; under `families.every_family`, each family's tiny model in turn."""
    if hasattr(request, "param"):
        return family_model_of(request.param).model
    return lenskit.HookedTransformer.from_hf(hf_model)


@pytest.fixture
def tokens() -> torch.Tensor:
    return torch.randint(0, 101, (3, 17), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    path = Path(lenskit.DEFAULT_MODEL)
    if not (path / "model.safetensors").exists():
        pytest.fail(f"the embedded model is missing at {path}; run experiments/train_default_model.py")
    return path


@pytest.fixture(scope="session")
def default_model(default_model_path) -> lenskit.HookedTransformer:
    return lenskit.HookedTransformer.from_pretrained(default_model_path)


from families import FAMILY_BUILDERS, family_model_of  # noqa: E402 - it builds with make_hf_family above


@pytest.fixture(scope="session", params=list(FAMILY_BUILDERS))
def family_model(request):
    """A tiny random model of each family in tests/families.py (its transformers twin in `.hf`)."""
    return family_model_of(request.param)

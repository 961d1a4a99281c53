"""Shared fixtures: small random GPT-2s built with `transformers`, so no test needs a download."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import transformers

import lenskit
from lenskit.families import FAMILIES as REGISTRY

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


def make_hf_gpt2(seed: int = 0, **overrides) -> transformers.GPT2LMHeadModel:
    """A random fp32 GPT2LMHeadModel in eval mode (the registry's tiny GPT-2: 3 layers, d_model 32, vocabulary
    101, unless `overrides` say otherwise, e.g. `n_layer=2`), with LayerNorm gains and biases moved away from 1
    and 0 so that a wrong norm implementation cannot hide behind the identity."""
    return make_hf_family("gpt2", seed=seed, **overrides)


def _perturb(model: torch.nn.Module) -> None:
    """Norm gains away from 1 and biases away from 0, so a wrong norm or a dropped bias cannot hide; attention sinks
    (gpt-oss) far from zero, so that a sink takes anything from a small share of a query's attention to most of it."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name or "ln_f" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("bias"):  # also gpt-oss's fused expert biases, `gate_up_proj_bias`, `down_proj_bias`
                p.add_(torch.randn_like(p) * 0.05)
            elif name.endswith(".sinks"):
                p.add_(torch.randn_like(p) * 2.0)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-block scale of the stream, 1 in a fresh model
                b.mul_(0.5 + torch.rand_like(b))


# One tiny config per family, from the registry (lenskit.families: each record's `tiny`, which says what it
# exercises): model_type -> (transformers config class, model class, config kwargs). The golden tests use them.
FAMILY_CONFIGS = {t: (f.hf_config_class, f.hf_class, dict(f.tiny)) for t, f in REGISTRY.items()}
FAMILIES = list(FAMILY_CONFIGS)


def make_hf_family(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random fp32 transformers causal LM of `family`, eager attention, eval mode, perturbed norms."""
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

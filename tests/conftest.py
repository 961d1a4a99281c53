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


@pytest.fixture(scope="session")
def hf_model() -> transformers.GPT2LMHeadModel:
    return make_hf_gpt2()


@pytest.fixture(scope="session")
def model(hf_model) -> lenskit.HookedTransformer:
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

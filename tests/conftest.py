"""Shared fixtures: small random GPT-2s built with `transformers`, so no test needs a download."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from fixtures import random_tokens

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


def _is_worker(config: pytest.Config) -> bool:
    """Under pytest-xdist (`-n 2`), a worker process; the checks of the whole session run in the controller."""
    return hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _is_worker(session.config):
        session.config.stash[_STATUS] = checkout_status()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Tests never write into the checkout: the suite fails if `git status` changed while it ran."""
    if _is_worker(session.config):
        return
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


# The smoke tier (`python3 -m pytest -m smoke`, a few minutes at most on one core): every family through the golden
# tests and everything above the model, and every lens once, each by a test that checks it against a reference.
# Patterns are node ids relative to tests/, `*` matching anything; a pattern that names a collected file but none of
# its tests fails the run, so a renamed test cannot drop out of the tier unseen.
SMOKE = (
    "test_families.py::test_golden_fast_and_eager_paths[*-untied]",  # every family, fused and eager, vs transformers
    "test_families.py::test_golden_through_save_pretrained[*-single-file-untied]",  # every family: our files
    "test_every_family.py::*",  # every family: everything above the model (lenses, ablation, patching, attribution)
    "test_kv_cache.py::test_cached_steps_give_the_full_forwards_logits[*]",  # every family: the KV cache
    "test_generate_cache.py::test_cached_greedy_generation_is_the_uncached_one[*]",  # every family: generation
    "test_cli_lens.py::test_csv_and_html",  # the CLI
    "test_logit.py::test_every_stream_equals_transformers_ln_f_and_lm_head",
    "test_tuned.py::test_untrained_tuned_lens_is_the_logit_lens_at_every_layer",
    "test_tuned.py::test_save_load_gives_identical_outputs_and_no_pickle[gpt2]",
    "test_jacobian.py::test_fit_is_the_averaged_jacobian_on_every_family[gpt2]",
    "test_patchscope.py::test_batched_rows_equal_a_hand_written_patch_one_row_at_a_time[gpt2]",
    "test_transfer.py::test_an_untrained_lens_gives_the_logit_lens_kl_in_every_row",
    "test_causal.py::test_mean_ablate_is_the_hand_projection_and_the_packages_remove_subspace",
    "test_trajectory.py::test_rows_agree_with_full_vocab_reference",
    "test_default_model.py::test_transformers_and_lenskit_agree[stdlib-gpt2]",
)

# The golden tier (`-m golden`): parity with transformers on the same weights, which the suite names in the test
# (`test_golden_...`, `..._parity`, `..._matches_transformers...`): new tests named that way join it unmarked.
GOLDEN = re.compile(r"golden|parity|transformers(?!_lens)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).resolve().parent
    smoke = {p: re.compile(re.escape(p).replace(r"\*", ".*")) for p in SMOKE}
    found: dict[str, bool] = {}
    for item in items:
        node = item.nodeid.split("tests/", 1)[-1]
        if GOLDEN.search(item.originalname if isinstance(item, pytest.Function) else item.name):
            item.add_marker(pytest.mark.golden)
        for pattern, match in smoke.items():
            if pattern.split("::")[0] == node.split("::")[0]:
                found.setdefault(pattern, False)
                if match.fullmatch(node):
                    item.add_marker(pytest.mark.smoke)
                    found[pattern] = True
    lost = [p for p, hit in found.items() if not hit and not config.getoption("-k") and (tests / p.split("::")[0]).is_file()]
    if lost and not config.getoption("deselect"):
        raise pytest.UsageError(f"the smoke tier names tests that were not collected: {lost}; "
                                "rename them in tests/conftest.py's SMOKE")


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
            elif name.endswith((".alpha_p", ".alpha_n")):  # Apertus's xIELU scalars: each block its own
                p.add_(torch.randn_like(p) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-block scale of the stream, 1 in a fresh model
                b.mul_(0.5 + torch.rand_like(b))
            elif name.endswith("act_fn.beta") or name.endswith("act_fn.eps"):  # xIELU's, read from the checkpoint
                b.copy_(0.5 * torch.rand_like(b) + 0.25 if name.endswith("beta") else -0.1 * torch.rand_like(b))
            elif name.endswith("e_score_correction_bias"):  # DeepSeek V3's, zero in a fresh model: let it steer choices
                b.normal_(std=0.3)


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
    return random_tokens(3, 17, seed=1)


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


@pytest.fixture
def loads(monkeypatch):
    """Every model loaded while a test runs (the CLI's commands included): (dtype, device type) of its weights, in
    order."""
    import lenskit.io.loading

    seen, original = [], lenskit.io.loading.load_pretrained

    def spy(*args, **kwargs):
        model = original(*args, **kwargs)
        seen.append((model.embed.weight.dtype, model.embed.weight.device.type))
        return model

    monkeypatch.setattr(lenskit.io.loading, "load_pretrained", spy)
    return seen

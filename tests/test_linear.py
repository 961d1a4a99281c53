"""lenskit.pieces.linear: half-precision matmuls on the CPU, natively or upcast to float32, and the rule between them
(the CPU's reported flags: never a timing, never the size of a call)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_hf_gpt2

import lenskit.pieces.linear as L
from lenskit import HookedTransformer


@pytest.fixture
def mode(monkeypatch):
    def set_mode(value: str) -> None:
        monkeypatch.setattr(L, "HALF_MATMUL", value)

    return set_mode


def cpu_with(monkeypatch, *flags: str) -> None:
    """Pretend the CPU reports these flags (as /proc/cpuinfo would), under the rule whatever LENSKIT_HALF_MATMUL says."""
    monkeypatch.setattr(L, "HALF_MATMUL", "auto")
    monkeypatch.setattr(L, "cpu_flags", lambda: frozenset(flags))


@pytest.mark.parametrize("flags, dtype, upcast", [
    (("avx2", "avx512f"), torch.bfloat16, True),              # a Xeon without bf16 instructions
    (("avx2", "avx512f", "avx512_bf16"), torch.bfloat16, False),
    (("avx2", "amx_bf16", "amx_tile"), torch.bfloat16, False),
    (("avx2", "avx512_bf16"), torch.float16, True),          # bf16 instructions say nothing about fp16
    (("avx512_fp16",), torch.float16, False),
    (("fp", "asimd", "bf16"), torch.bfloat16, False),         # an Arm core's Features line
    ((), torch.bfloat16, False),                              # flags unreadable (not Linux): stock behaviour
])
def test_the_rule_reads_the_cpu_flags(monkeypatch, flags, dtype, upcast):
    cpu_with(monkeypatch, *flags)
    assert L.half_matmul_in_float32(dtype) is upcast


def test_this_machines_flags_are_read():
    flags = L.cpu_flags()
    assert isinstance(flags, frozenset)
    if Path("/proc/cpuinfo").exists() and platform.machine() in ("x86_64", "AMD64"):
        assert "sse2" in flags  # every x86-64 CPU has it, so the line was found and split


@pytest.mark.parametrize("flags", [("avx512f",), ("avx512f", "avx512_bf16")])
def test_prompts_of_255_and_256_tokens_follow_the_rule(monkeypatch, flags, mode):
    """A bf16 model on 255 and 256 tokens: every projection takes the rule's path (an earlier version
    switched paths at 256 rows), and each run is bit-identical to the same run with that path forced."""
    cpu_with(monkeypatch, *flags)
    upcast = L.half_matmul_in_float32(torch.bfloat16)
    assert upcast is ("avx512_bf16" not in flags)
    model = HookedTransformer.from_hf(make_hf_gpt2(seed=4, n_positions=256)).to(torch.bfloat16)
    n_linears = sum(isinstance(m, L.Linear) for m in model.modules())
    calls = []
    real = L.upcast_linear
    monkeypatch.setattr(L, "upcast_linear", lambda *a: calls.append(a[0].shape[-2]) or real(*a))
    gen = torch.Generator().manual_seed(1)
    for n in (255, 256):
        tokens = torch.randint(0, model.cfg.d_vocab, (1, n), generator=gen)
        calls.clear()
        with torch.no_grad():
            by_rule = model(tokens)
            assert len(calls) == (n_linears if upcast else 0), n
            mode("float32" if upcast else "native")
            forced = model(tokens)
        mode("auto")
        assert torch.equal(by_rule, forced), n


def test_a_slow_or_fast_machine_gives_the_same_numbers(monkeypatch):
    """Nothing in lenskit.pieces.linear looks at the clock: a machine that seems ten times slower, or whose clock
    jumps, computes bit-identical logits."""
    cpu_with(monkeypatch, "avx512f")  # the upcast path, the one an earlier version chose by timing
    model = HookedTransformer.from_hf(make_hf_gpt2(seed=5)).to(torch.bfloat16)
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(tokens)
    calls = []

    def slow_clock():
        calls.append(1)
        return 10.0 * len(calls) ** 2  # every reading much later than the one before

    monkeypatch.setattr(time, "perf_counter", slow_clock)
    monkeypatch.setattr(time, "time", slow_clock)
    monkeypatch.setattr(time, "monotonic", slow_clock)
    with torch.no_grad():
        after = model(tokens)
    assert torch.equal(before, after)
    assert not calls  # and the clock was never read


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_upcast_linear_is_the_float32_product_of_the_exact_operands_rounded_once(dtype, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 24, generator=gen).to(dtype)
    w = torch.randn(40, 24, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype) if bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())  # exact in float64 at these sizes
    got = L.upcast_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (3, 5, 40)
    # one rounding of a float32 result: within half a unit in the last place of the half-precision output
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    assert ((got.double() - want).abs() <= want.abs() * ulp + 1e-6).all()


def test_blocks_of_output_features_give_the_same_result(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(7, 16, generator=gen), torch.randn(50, 16, generator=gen), torch.randn(50, generator=gen)
    x, w, b = x.bfloat16(), w.bfloat16(), b.bfloat16()
    whole = L.upcast_linear(x, w, b)
    monkeypatch.setattr(L, "BLOCK_BYTES", 4 * 16 * 8)  # 8 output features a block: 7 blocks, the last one short
    blocked = L.upcast_linear(x, w, b)
    torch.testing.assert_close(blocked, whole, rtol=2**-7, atol=1e-6)


def test_float32_weights_and_native_mode_are_plain_f_linear(mode):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 8, generator=gen), torch.randn(6, 8, generator=gen)
    assert torch.equal(L.linear(x, w), F.linear(x, w))
    mode("native")
    assert torch.equal(L.linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))
    mode("float32")
    assert torch.equal(L.linear(x.bfloat16(), w.bfloat16()), L.upcast_linear(x.bfloat16(), w.bfloat16()))


def test_the_choice_is_a_bool_and_a_bad_setting_is_refused(mode):
    assert isinstance(L.half_matmul_in_float32(torch.bfloat16), bool)
    mode("fast")
    with pytest.raises(ValueError, match="HALF_MATMUL must be 'auto', 'native' or 'float32'"):
        L.linear(torch.ones(1, 2, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("value", ["auto", "native", "float32"])
def test_the_environment_chooses_the_path(value):
    code = "import lenskit.pieces.linear as L; print(L.HALF_MATMUL)"
    env = {**os.environ, "LENSKIT_HALF_MATMUL": value}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == value


def test_a_bad_environment_value_is_refused_in_one_line():
    env = {**os.environ, "LENSKIT_HALF_MATMUL": "fp32"}
    run = subprocess.run([sys.executable, "-c", "import lenskit"], env=env, capture_output=True, text=True)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "LENSKIT_HALF_MATMUL must be 'auto', 'native' or 'float32', got 'fp32'" in last, run.stderr


def test_linear_is_an_nn_linear_with_the_same_state_dict():
    layer = L.Linear(4, 3)
    assert isinstance(layer, torch.nn.Linear)
    assert set(layer.state_dict()) == {"weight", "bias"}


def test_bf16_model_upcast_agrees_with_native_and_with_transformers(mode):
    hf = make_hf_gpt2(seed=3).to(torch.bfloat16).eval()
    model = HookedTransformer.from_hf(hf)
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(tokens).logits.float()
        mode("native")
        native = model(tokens).float()
        mode("float32")
        upcast = model(tokens).float()
    assert model(tokens).dtype == torch.bfloat16
    spread = (native - want).abs().max()
    assert (upcast - want).abs().max() <= max(2 * spread, 0.05)  # bf16 rounding of the activations, nothing more
    assert (upcast - native).abs().max() <= 0.05


def test_gradients_flow_through_the_upcast_path(mode):
    mode("float32")
    layer = L.Linear(5, 3).bfloat16()
    x = torch.randn(2, 5).bfloat16().requires_grad_()
    layer(x).float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None and layer.weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), layer.weight.float().sum(0).expand(2, 5), rtol=2**-7, atol=1e-2)

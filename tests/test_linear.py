"""lenskit.linear: half-precision matmuls on the CPU, natively or upcast to float32, and the choice between them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lenskit.linear as L
from conftest import make_hf_gpt2
from lenskit import HookedTransformer


@pytest.fixture
def mode(monkeypatch):
    monkeypatch.setattr(L, "MIN_ROWS", 1)  # the small test inputs take the upcast path too

    def set_mode(value: str) -> None:
        monkeypatch.setattr(L, "HALF_MATMUL", value)

    return set_mode


def test_few_rows_multiply_natively_even_where_upcasting_is_chosen(monkeypatch):
    monkeypatch.setattr(L, "HALF_MATMUL", "float32")
    w = torch.randn(6, 8).bfloat16()
    few = torch.randn(L.MIN_ROWS - 1, 8).bfloat16()
    many = torch.randn(2, L.MIN_ROWS // 2, 8).bfloat16()
    assert torch.equal(L.linear(few, w), F.linear(few, w))
    assert torch.equal(L.linear(many, w), L.upcast_linear(many, w))


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


def test_the_choice_is_a_measured_bool_and_a_bad_setting_is_refused(mode):
    assert isinstance(L.half_matmul_in_float32(torch.bfloat16), bool)
    assert L._measured_faster_in_float32.cache_info().currsize >= 1  # measured once, then remembered
    mode("fast")
    with pytest.raises(ValueError, match="HALF_MATMUL must be 'auto', 'native' or 'float32'"):
        L.linear(torch.ones(1, 2, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16))


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

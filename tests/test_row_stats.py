"""lenses.row_stats: per-row logit statistics, from the C++ kernel and from torch ops, against float64."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from lenses import row_stats as R

# The kernel must build wherever torch runs AVX2/AVX-512 code and a C++ compiler is installed (CI's machine).
BUILDABLE = torch.backends.cpu.get_cpu_capability() in R.FLAGS and shutil.which("c++") is not None


def run(z: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    rows = len(z)
    out = {k: torch.full((rows,), 123.0) for k in ("at_ref", "runner_up", "mass", "weighted")}
    out["agree"] = torch.zeros(rows, dtype=torch.bool)
    R.row_stats(z.clone(), ref, out["at_ref"], out["runner_up"], out["mass"], out["weighted"], out["agree"],
                torch.empty_like(z))
    return out


def reference(z: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """The definitions, longhand, in float64."""
    zd = z.double()
    at = zd.gather(1, ref[:, None]).squeeze(1)
    others = zd.scatter(1, ref[:, None], -torch.inf)
    runner = others.amax(-1)
    peak = torch.maximum(at, runner)[:, None]
    e = (zd - peak).exp()
    return {"at_ref": at, "runner_up": runner, "mass": e.sum(-1), "weighted": (e * (zd - peak)).sum(-1),
            "agree": z.argmax(-1) == ref}


@pytest.fixture(params=["auto", "torch"])
def path(request, monkeypatch):
    monkeypatch.setattr(R, "FUSED", request.param)
    if request.param == "auto":
        assert R.kernel_available() is BUILDABLE, "the kernel should build on this machine (see the warning)"
    return request.param


@pytest.mark.parametrize("d_vocab", [4096, 1000, 17, 16, 3, 1])  # whole vectors, a short last piece, less than one
def test_statistics_match_float64_definitions(path, d_vocab):
    gen = torch.Generator().manual_seed(d_vocab)
    z = torch.randn(70, d_vocab, generator=gen) * 4 + 10  # logits far from 0: the shift by the peak matters
    ref = torch.randint(0, d_vocab, (70,), generator=gen)
    ref[:10] = z[:10].argmax(-1)  # rows where the reference is the maximum
    got, want = run(z, ref), reference(z, ref)
    assert torch.equal(got["at_ref"], want["at_ref"].float())
    assert torch.equal(got["runner_up"], want["runner_up"].float())
    assert torch.equal(got["agree"], want["agree"])
    assert got["agree"][:10].all()
    for k in ("mass", "weighted"):
        torch.testing.assert_close(got[k].double(), want[k], rtol=1e-5, atol=1e-5, msg=k)


def test_ties_take_the_first_maximum_as_argmax(path):
    z = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    z[0, [3, 9]] = 50.0   # reference 9 ties with an earlier token: not the argmax
    z[1, [3, 9]] = 50.0   # reference 3 is the first of the tie: the argmax
    z[2] = 1.0            # every token ties: argmax is token 0
    z[3] = 1.0
    z[4, 39] = 50.0       # the maximum alone, in the last column
    z[5, [0, 39]] = 50.0  # reference 39 ties with token 0
    ref = torch.tensor([9, 3, 5, 0, 39, 39])
    got = run(z, ref)
    assert got["agree"].tolist() == (z.argmax(-1) == ref).tolist() == [False, True, False, True, True, False]
    torch.testing.assert_close(got["mass"].double(), reference(z, ref)["mass"], rtol=1e-5, atol=1e-6)


def test_nan_and_infinite_logits_propagate_as_torch_ops_do(path):
    z = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    z[0, 5] = float("nan")
    z[1, 7] = -torch.inf  # a token of zero mass: its exp is 0, and 0 * -inf is NaN in the weighted sum
    z[2] = -torch.inf     # every token -inf: no peak to shift by
    ref = torch.tensor([1, 2, 3, 4])
    got = run(z, ref)
    assert got["mass"][0].isnan() and got["weighted"][0].isnan()
    assert torch.isfinite(got["mass"][1]) and got["weighted"][1].isnan()
    assert got["mass"][2].isnan()
    assert torch.isfinite(got["mass"][3]) and torch.isfinite(got["weighted"][3])


def test_kernel_and_torch_ops_agree_and_the_kernel_uses_torch_threads(monkeypatch):
    if not BUILDABLE:
        pytest.skip("no AVX2/AVX-512 capability or no C++ compiler here: only the torch-op path exists")
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(513, 300, generator=gen) * 3
    ref = torch.randint(0, 300, (513,), generator=gen)
    results = {}
    threads = torch.get_num_threads()
    try:
        for fused, n in [("auto", 1), ("auto", 2), ("torch", threads)]:
            monkeypatch.setattr(R, "FUSED", fused)
            torch.set_num_threads(n)
            results[fused, n] = run(z, ref)
    finally:
        torch.set_num_threads(threads)
    for k in ("at_ref", "runner_up", "agree", "mass", "weighted"):
        assert torch.equal(results["auto", 1][k], results["auto", 2][k]), k  # rows are independent of threads
        torch.testing.assert_close(results["auto", 1][k], results["torch", threads][k], rtol=1e-6, atol=1e-6)


def test_an_unknown_setting_is_refused(monkeypatch):
    monkeypatch.setattr(R, "FUSED", "cuda")
    with pytest.raises(ValueError, match="'auto' or 'torch'"):
        run(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))


def test_a_failed_build_warns_once_and_falls_back_to_torch_ops(monkeypatch):
    monkeypatch.setattr(R, "FLAGS", {torch.backends.cpu.get_cpu_capability(): ["-DNO_SUCH_FLAG"]})

    def fail(capability=None):
        raise RuntimeError("Error building extension 'lenskit_row_stats': c++ not found\nmore lines")

    monkeypatch.setattr(R, "build", fail)
    R._built.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            z = torch.randn(5, 20, generator=torch.Generator().manual_seed(3))
            ref = torch.arange(5)
            got = run(z, ref)
            run(z, ref)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1 and "c++ not found" in messages[0] and "more lines" not in messages[0]
        assert not R.kernel_available()
        torch.testing.assert_close(got["mass"].double(), reference(z, ref)["mass"], rtol=1e-5, atol=1e-6)
    finally:
        R._built.cache_clear()  # the next caller builds (loads) the real kernel again

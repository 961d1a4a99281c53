"""No host synchronisation inside the chunk loops (issue 39): the calls that would make the host wait for a device
are counted during a trajectory and an evaluation of many chunks, and their number must not grow with the number
of chunks. On the CPU nothing waits, so the calls themselves are counted: the aten ops that read a value back to
Python (`.item()`, `bool(t)`, `if t.any()`, boolean indexing's `nonzero`, `torch.equal`) through a
TorchDispatchMode, and `Tensor.cpu` / `.tolist` / `.numpy` through wrappers."""

from __future__ import annotations

import pytest
import torch
from lens_fixtures import random_tuned
from torch.utils._python_dispatch import TorchDispatchMode

from lenses import LogitLens, Trajectory, chunks, evaluation, trajectory
from lenses.evaluation import evaluate_windows

# ops whose result is read by the host: on a GPU each waits for the device
READBACK = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "masked_select", "unique", "_unique2"}
METHODS = ("cpu", "tolist", "numpy", "item")


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in READBACK:
            self.calls.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def readbacks(monkeypatch: pytest.MonkeyPatch, call) -> list[str]:
    """The host read-backs `call()` makes, in order."""
    counter = _Count()
    for name in METHODS:
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, _original=original, _name=name, **kwargs):
            counter.calls.append(f"Tensor.{_name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    try:
        with counter:
            call()
    finally:
        monkeypatch.undo()
    return counter.calls


@pytest.fixture
def tokens():
    return torch.randint(0, 101, (3, 12), generator=torch.Generator().manual_seed(1))


def test_a_trajectory_reads_back_the_same_whatever_the_number_of_chunks(model, tokens, monkeypatch):
    lens = LogitLens(model)
    many = readbacks(monkeypatch, lambda: Trajectory.from_prompt(lens, tokens, chunk_size=1))   # 36 chunks
    few = readbacks(monkeypatch, lambda: Trajectory.from_prompt(lens, tokens, chunk_size=36))   # 1 chunk
    assert many == few and len(many) <= 32, many


def test_an_evaluation_reads_back_the_same_whatever_the_number_of_chunks(model, tokens, monkeypatch):
    lenses = {"logit": LogitLens(model), "tuned": random_tuned(model)}

    def run(rows: int):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(evaluation, "chunk_rows", lambda readout, buffers: rows)
            return readbacks(monkeypatch, lambda: evaluate_windows(model, lenses, tokens, batch=3, progress=False))

    calls = []
    honest = evaluation.cross_term
    with pytest.MonkeyPatch.context() as m:  # counts the chunks, to show that there are many
        m.setattr(evaluation, "cross_term", lambda *args: calls.append(1) or honest(*args))
        many, few = run(1), run(36)  # 36 chunks of one row, or one of every row
    assert len(calls) == (36 + 1) * 2 * model.cfg.n_layers  # 2 lenses; the logit lens's last stream is the model's
    assert many == few and len(many) <= 64, many


def test_the_count_catches_a_read_back_inside_the_loop(model, tokens, monkeypatch):
    """The check can fail: one `.item()` per chunk and layer, slipped into the loop, shows up as a count that
    grows with the number of chunks."""
    lens = LogitLens(model)
    honest = chunks.cross_term

    def syncing(f_e, z, scratch):
        out = honest(f_e, z, scratch)
        out.sum().item()  # what a debugging `if torch.isnan(x).any():` would do
        return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(trajectory, "cross_term", syncing)
        many = readbacks(monkeypatch, lambda: Trajectory.from_prompt(lens, tokens, chunk_size=1))
        few = readbacks(monkeypatch, lambda: Trajectory.from_prompt(lens, tokens, chunk_size=36))
    assert len(many) - len(few) == (36 - 1) * 2 * model.cfg.n_layers  # `.item()` and its _local_scalar_dense


def test_a_jacobian_fit_reads_nothing_back_per_backward(model, monkeypatch):
    """One prompt's Jacobians read back the same whether they take 8 backward passes (dim_batch 4 of d_model 32) or
    one (dim_batch 32): nothing per backward. What is left is the model's forward, once per prompt: its token
    check and, on the CPU only, the fused attention's finiteness check (a CUDA tensor skips it)."""
    from lenses import jacobian_fit
    from lenses.jacobian import JacobianLens

    prompts = torch.randint(0, 101, (3, 10), generator=torch.Generator().manual_seed(2))
    seen: list[list[str]] = []
    honest = jacobian_fit.prompt_jacobians

    def counted(*args, **kwargs):
        out = []
        seen.append(readbacks(pytest.MonkeyPatch(), lambda: out.extend(honest(*args, **kwargs))))
        return out

    monkeypatch.setattr(jacobian_fit, "prompt_jacobians", counted)
    for dim_batch in (4, 32):
        jacobian_fit.fit(JacobianLens, model, prompts, skip_first_positions=2, dim_batch=dim_batch, progress=False)
    assert len(seen) == 6 and all(calls == seen[0] for calls in seen), seen
    assert len(seen[0]) <= 2 * (1 + model.cfg.n_layers), seen[0]  # `.item()` and its aten op, per check

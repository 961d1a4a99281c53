"""Fitting a Jacobian lens: exact per-prompt Jacobians by batched vector-Jacobian products; resumable, distributable.

For one prompt of T tokens and valid positions V = [skip, end), end = T - 1 (or T with exclude_last=False):
one forward of the prompt replicated `dim_batch` times along the batch, then d_model / dim_batch backward passes.
Batch row b of pass p carries a one-hot cotangent in output dimension i = p * dim_batch + b at every target position
t' in V; the model being causal, the gradient at source position t is then the sum over t' >= t, with no masking.
Averaged over t in V, the gradients at every fitted stream are row i of that prompt's J_s, all streams at once.
The forward stops at `end`: position T - 1 is neither source nor target, and moves nothing before it.
Prompts count equally: J_s = (sum over prompts) / (number of prompts). The sums stay on the model's device, in
float64 where the device runs it at speed (`accumulator_dtype`), else in float32 with Kahan's compensated sums;
nothing is copied to the host per prompt or per backward. `dim_batch` defaults to the device's (`dim_batch_for`).

Resuming: with `out`, the fit holds the folder's lock and, every `checkpoint_every` prompts, at most every
`checkpoint_minutes` (in one process) and on Ctrl-C, SIGTERM, SIGHUP or SIGUSR1,
writes the sums, the counts, the next prompt index and the fit's identity (settings, a digest of the tokens, the
model's fingerprint) to `out/jacobian_checkpoint.safetensors`, atomically. A rerun resumes from it, adding the
remaining prompts in the same order, so it ends with exactly the J of a run that never stopped; a checkpoint of
other settings, tokens or model is refused. At the end the lens folder is saved in `out` and the checkpoint removed.

Distributed (torchrun, see `lenses.training.init_distributed`): rank r takes prompts r, r + world, ...; the sums
and counts are all-reduced, so the lens is one process's up to float64 summation order; rank 0 writes the files.

>>> lens = fit(JacobianLens, model, windows[:2, :32], out="runs/jlens", progress=False)   # tokens [n, pos]; Ctrl-C, then the same call resumes
>>> sorted(p.name for p in Path("runs/jlens").iterdir())
['README.md', 'config.json', 'lens.safetensors']
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm  # tqdm.auto warns in kernels without ipywidgets

from lenskit import HookedTransformer, Stream
from lenskit.observe.backward import check_gradients_possible
from lenskit.observe.stream import as_stream

from .card import JACOBIAN_FORMAT as FORMAT
from .chunks import device_budget
from .io import CONFIG_FILE, read_config, write_atomic
from .jacobian_io import load_folder
from .stopping import SAVE_MINUTES, SaveClock, StopGuard
from .training import check_same_run, distributed
from .training.lock import locks_out_folder
from .tuned import model_fingerprint

if TYPE_CHECKING:
    from .jacobian import JacobianLens

SKIP_FIRST_POSITIONS = 16  # the reference's: early positions (attention sinks) have atypical streams
# Output dimensions per backward pass of the fit. On a 2-core CPU (the embedded 6-block d_model-192 GPT-2, 128-token
# prompts) 4 and 8 are the fastest; from 16 up it is slower again (the replicated activations outgrow the caches, and
# the forward runs dim_batch copies of the prompt). benchmarks/bench_jacobian.py --sweep 4,16 measures it. The CPU's;
# on CUDA `dim_batch_for` sizes it from the device's memory.
DIM_BATCH = 8
CHECKPOINT_EVERY = 16  # prompts between checkpoints of a fit with out=FOLDER

CHECKPOINT_FILE = "jacobian_checkpoint.safetensors"


@dataclass(frozen=True)
class Estimator:
    """What J_s is averaged over: the fitted streams and each prompt's valid positions [skip, end)."""

    skip_first_positions: int
    exclude_last: bool
    streams: tuple[int, ...]

    def end(self, n_tokens: int) -> int:
        """One past the last valid position of a prompt of n_tokens (where its forward stops)."""
        return n_tokens - 1 if self.exclude_last else n_tokens

    @property
    def min_tokens(self) -> int:
        """The fewest tokens a prompt needs for one valid position."""
        return self.skip_first_positions + (2 if self.exclude_last else 1)

    def identity(self) -> dict[str, Any]:
        return {"skip_first_positions": self.skip_first_positions, "exclude_last": self.exclude_last,
                "streams": list(self.streams)}


def accumulator_dtype(model: HookedTransformer) -> torch.dtype:
    """The dtype the fit sums in on the model's device: float64 on the CPU, on a float64 model, and on CUDA chips
    with full-rate float64 (compute capability x.0 from 6.0: P100, V100, A100, H100, B200); float32 elsewhere
    (consumer GPUs run float64 at 1/32-1/64 of float32; MPS has none), where `Sum` compensates. Decided by the
    device, never by timing."""
    device = model.unembed.weight.device
    if device.type == "cpu" or model.unembed.weight.dtype == torch.float64:
        return torch.float64
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return torch.float64 if major >= 6 and minor == 0 else torch.float32
    return torch.float32


def dim_batch_for(model: HookedTransformer, n_tokens: int) -> int:
    """Output dimensions per backward pass on the model's device: DIM_BATCH on the CPU (measured there: larger
    batches fall out of cache); on CUDA as many as the autograd graph of that many copies of an n_tokens prompt
    fits in the chunk budget (`lenses.chunks.device_budget`), at most d_model. A copy's graph is estimated at
    n_tokens x n_layers x (8 d_model + 3 d_mlp + n_heads x n_tokens) elements of the model's dtype."""
    device, cfg = model.unembed.weight.device, model.cfg
    if device.type != "cuda":
        return DIM_BATCH
    per_copy = n_tokens * cfg.n_layers * (8 * cfg.d_model + 3 * cfg.d_mlp + cfg.n_heads * n_tokens)
    per_copy *= model.unembed.weight.element_size()
    return max(1, min(cfg.d_model, device_budget(device) // per_copy))


class Sum:
    """A running sum of tensors on their device: plain in float64, Kahan-compensated in float32 (the error of
    n additions stays near one rounding instead of growing with n). `value()` is the sum in float64."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.total = torch.zeros(shape, dtype=dtype, device=device)
        self.carry = torch.zeros_like(self.total) if dtype != torch.float64 else None  # what the total lost

    def add(self, x: torch.Tensor) -> None:
        if self.carry is None:
            self.total += x
            return
        y = x - self.carry
        t = self.total + y
        self.carry = (t - self.total) - y  # in this order: the low bits that t could not hold
        self.total = t

    def value(self) -> torch.Tensor:
        if self.carry is None:
            return self.total
        return self.total.double() - self.carry.double()


def prompt_jacobians(model: HookedTransformer, prompt: torch.Tensor, est: Estimator, dim_batch: int,
                     dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """For one prompt [pos], each fitted stream's (1/|V|) sum_{t in V} sum_{t' in V} d h_final,t' / d h_s,t:
    [d_model, d_model] in `dtype`, on the model's device (row i: output dimension i). The model's parameters
    must be frozen."""
    n, d = model.cfg.n_layers, model.cfg.d_model
    skip, end = est.skip_first_positions, est.end(len(prompt))
    names = [Stream(s).hook_name(n) for s in est.streams]  # in depth order: names[0] is the earliest
    captured: dict[str, torch.Tensor] = {}

    def capture(x: torch.Tensor, hook: Any) -> torch.Tensor:
        if hook.name == names[0]:
            x = x.detach().requires_grad_(True)  # the graph starts at the earliest fitted stream
        captured[hook.name] = x
        return x

    batch = min(dim_batch, d)
    with torch.enable_grad(), model.hooks([(name, capture) for name in names]):
        final = model(prompt[:end].expand(batch, -1), stop_at_layer=n)  # [batch, pos, d_model], before the final norm
    sources = [captured[name] for name in names]
    rows = torch.arange(batch, device=final.device)
    targets = torch.arange(skip, end, device=final.device)
    cotangent = torch.zeros_like(final)
    out = [torch.empty(d, d, dtype=dtype, device=final.device) for _ in names]
    for start in range(0, d, batch):
        k = min(batch, d - start)
        cotangent.zero_()
        cotangent[rows[:k, None], targets, start + rows[:k, None]] = 1.0  # row b: output dim start + b, every target
        grads = torch.autograd.grad(final, sources, cotangent, retain_graph=start + batch < d)
        for J, g in zip(out, grads):
            J[start:start + k] = g[:k, skip:end].sum(1, dtype=dtype) / (end - skip)  # [k, d_model]: rows of J_s
    return out


@locks_out_folder  # one fit per out folder (lenses/training/lock.py)
def fit(cls: type[JacobianLens], model: HookedTransformer, tokens: torch.Tensor | Sequence[torch.Tensor], *,
        skip_first_positions: int = SKIP_FIRST_POSITIONS, streams: Sequence[int | str | Stream] | None = None,
        exclude_last: bool = True, dim_batch: int | None = None, progress: bool = True, out: str | os.PathLike | None = None,
        provenance: dict | None = None, checkpoint_every: int = CHECKPOINT_EVERY,
        checkpoint_minutes: float = SAVE_MINUTES) -> JacobianLens:
    """`JacobianLens.fit` (see there for the settings). The model is left as it was: parameters' requires_grad and
    train/eval mode are restored, and no hook stays attached, also when the fit raises."""
    check_gradients_possible("JacobianLens.fit")
    rank, world = distributed()
    n, d = model.cfg.n_layers, model.cfg.d_model
    for name, value, low in (("skip_first_positions", skip_first_positions, 0), ("dim_batch", dim_batch, 1),
                             ("checkpoint_every", checkpoint_every, 1)):
        if name == "dim_batch" and value is None:
            continue  # the device's
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    est = Estimator(skip_first_positions, bool(exclude_last), fitted_streams(n, streams))
    provenance = plain_json(provenance or {}, "provenance")
    prompts = as_prompts(model, tokens, est)
    usable = [len(p) >= est.min_tokens for p in prompts]
    if rank == 0 and not all(usable):
        short = [i for i, ok in enumerate(usable) if not ok]
        warnings.warn(f"skipping {len(short)} of {len(prompts)} prompts shorter than {est.min_tokens} tokens "
                      f"(skip_first_positions + {est.min_tokens - est.skip_first_positions}): prompts {short[:8]}"
                      f"{' ...' if len(short) > 8 else ''}", UserWarning, stacklevel=3)
    identity = {"estimator": est.identity(), "tokens_sha256": tokens_digest(prompts), "n_prompts_given": len(prompts),
                "model_fingerprint": model_fingerprint(model), "model_dtype": str(model.unembed.weight.dtype)}
    out = Path(out) if out is not None else None
    if out is not None and (out / CONFIG_FILE).exists():
        return finished_fit(cls, out, model, identity, rank)
    ckpt = out / CHECKPOINT_FILE if out is not None else None
    device, dtype = model.unembed.weight.device, accumulator_dtype(model)
    sums = [Sum((d, d), dtype, device) for _ in est.streams]
    counts = [0, 0]  # prompts summed, their tokens: counted on the host, which knows them
    start = 0
    if ckpt is not None and ckpt.exists():
        start, saved_sums, saved_counts = load_checkpoint(ckpt, identity, len(est.streams), d)
        if rank == 0:  # the other ranks start from zero: the all-reduce adds the saved sums once
            for J, saved in zip(sums, saved_sums):
                J.add(saved.to(device=device, dtype=dtype))
            counts = [int(c) for c in saved_counts.tolist()]
            print(f"resuming the Jacobian lens fit at prompt {start} of {len(prompts)} ({ckpt})", flush=True)

    def checkpoint(next_index: int) -> None:
        total_sums, total_counts = all_reduced([J.value() for J in sums], torch.tensor(counts, device=device), world)
        if rank == 0:
            save_checkpoint(ckpt, est, total_sums, total_counts, next_index, identity)

    frozen = [p for p in model.parameters() if p.requires_grad]
    was_training = model.training
    bar = tqdm(total=len(prompts), initial=start, desc="jacobian lens", unit="prompt", dynamic_ncols=True,
               disable=not progress or rank != 0)
    done = start
    clock = SaveClock(checkpoint_minutes)
    guard = StopGuard().install()  # Ctrl-C, SIGTERM, SIGHUP, SIGUSR1: stop between prompts (lenses.stopping)
    try:
        model.eval()
        for p in frozen:  # gradients flow to the streams only, never into the weights
            p.requires_grad_(False)
        for i in range(start, len(prompts)):
            if guard.requested.is_set():
                raise KeyboardInterrupt
            if i % world == rank and usable[i]:
                batch = dim_batch or dim_batch_for(model, est.end(len(prompts[i])))
                guard.interruptible = True  # a prompt's passes may be dropped; the sums below change whole or not at all
                adds = prompt_jacobians(model, prompts[i], est, batch, dtype)
                guard.interruptible = False
                for J, add in zip(sums, adds):
                    J.add(add)
                counts = [counts[0] + 1, counts[1] + len(prompts[i])]
            done = i + 1
            bar.update(1)
            # By time only in one process: every rank must reach a checkpoint at the same i.
            if ckpt is not None and (done % checkpoint_every == 0 or world == 1 and clock.due()) and done < len(prompts):
                checkpoint(done)  # every rank reaches this at the same i
                clock.saved()
    except KeyboardInterrupt:
        guard.interruptible = False
        if ckpt is not None and world == 1:  # keep the whole prompts done; the same call resumes
            checkpoint(done)
        raise
    finally:
        guard.restore()
        bar.close()
        for p in frozen:
            p.requires_grad_(True)
        model.train(was_training)

    total_sums, total_counts = all_reduced([J.value() for J in sums], torch.tensor(counts, device=device), world)
    n_done, n_tokens = (int(c) for c in total_counts.tolist())  # once, after the loop
    dtype = torch.float64 if model.unembed.weight.dtype == torch.float64 else torch.float32
    info = {"estimator": {"skip_first_positions": est.skip_first_positions, "exclude_last": est.exclude_last,
                          "n_prompts": n_done, "n_tokens": n_tokens, "n_skipped": usable.count(False)},
            "data": provenance, "fit_identity": identity}
    lens = cls(model, {s: (J / n_done).to(dtype) for s, J in zip(est.streams, total_sums)}, info)
    if out is not None and rank == 0:
        lens.save(out)
        ckpt.unlink(missing_ok=True)  # the finished lens replaces it
    if world > 1:
        dist.barrier()
    return lens


# ------------------------------------------------------------------ inputs
def fitted_streams(n_layers: int, streams: Sequence[int | str | Stream] | None) -> tuple[int, ...]:
    """The stream indices to fit, sorted: every stream 0..n_layers-1 for None (resid_post l is stream l + 1)."""
    if streams is None:
        return tuple(range(n_layers))
    chosen = set()
    for spec in ([streams] if isinstance(streams, (int, str, Stream)) else streams):
        s = as_stream(spec).resolve(n_layers).canonical()
        if s.point != "resid_pre":
            raise ValueError(f"a Jacobian lens is fitted at block boundaries (streams 0..{n_layers - 1}), not at {s}")
        if s.layer == n_layers:
            raise ValueError(f"stream {n_layers} (after the last block) is the identity and is never fitted; "
                             f"pass streams in 0..{n_layers - 1}")
        chosen.add(s.layer)
    if not chosen:
        raise ValueError(f"streams is empty; pass None for every stream 0..{n_layers - 1}, or some of them")
    return tuple(sorted(chosen))


def as_prompts(model: HookedTransformer, tokens: torch.Tensor | Sequence[torch.Tensor], est: Estimator) -> list[torch.Tensor]:
    """One 1-D id tensor per prompt, on the model's device; ids, dtype and length checked (by the model) up front,
    so a bad prompt fails before any work. ValueError when no prompt is long enough."""
    if isinstance(tokens, torch.Tensor) and tokens.ndim != 2:
        raise ValueError(f"tokens must be [n, pos] ids or a list of 1-D id tensors, got a tensor of shape {tuple(tokens.shape)}")
    rows = list(tokens)
    if not rows or not all(isinstance(r, torch.Tensor) and r.ndim == 1 for r in rows):
        raise ValueError("tokens must be [n, pos] ids or a non-empty list of 1-D id tensors (one prompt each)")
    longest = max(len(r) for r in rows)
    if longest < est.min_tokens:
        extra = est.min_tokens - est.skip_first_positions
        raise ValueError(f"no prompt is long enough to fit on: with skip_first_positions={est.skip_first_positions}"
                         f"{' and exclude_last' if est.exclude_last else ''} a prompt needs at least {est.min_tokens} tokens "
                         f"(skip_first_positions + {extra}), and the longest of the {len(rows)} given has {longest}; "
                         "pass longer prompts or a smaller skip_first_positions")
    return [model.validate_tokens(r)[0] if len(r) >= est.min_tokens else r for r in rows]


def tokens_digest(prompts: list[torch.Tensor]) -> str:
    """sha256 of every prompt's length and ids (little-endian int64): what the fit's identity says it read."""
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(f"{len(p)}\n".encode())
        digest.update(np.ascontiguousarray(p.detach().cpu().long().numpy(), dtype="<i8").tobytes())
    return "sha256:" + digest.hexdigest()


def plain_json(value: Any, what: str) -> Any:
    """`value` as JSON would give it back (plain values only), or a one-line ValueError."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must hold plain JSON values (str, numbers, lists, dicts): {e}") from None


def all_reduced(sums: list[torch.Tensor], counts: torch.Tensor, world: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The sums and counts of every rank added up (this rank's own when there is one process)."""
    if world == 1:
        return sums, counts
    sums, counts = [J.clone() for J in sums], counts.clone()
    for t in (*sums, counts):
        dist.all_reduce(t)
    return sums, counts


# ------------------------------------------------------------------ checkpoints and a finished fit
def save_checkpoint(path: Path, est: Estimator, sums: list[torch.Tensor], counts: torch.Tensor, next_index: int,
                    identity: dict) -> None:
    tensors = {f"sum.{s}": J.detach().cpu().contiguous() for s, J in zip(est.streams, sums)}
    tensors["counts"] = counts.detach().cpu().contiguous()
    meta = json.dumps({"next_index": next_index, "identity": identity})
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata={"meta": meta}))


def load_checkpoint(path: Path, identity: dict, n_streams: int, d_model: int) -> tuple[int, list[torch.Tensor], torch.Tensor]:
    """(next prompt index, the float64 sums in stream order, the counts); refused unless it is this fit's."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {})["meta"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        streams = meta["identity"]["estimator"]["streams"]
        next_index = meta["next_index"]
        sums = [tensors[f"sum.{s}"] for s in streams]
        counts = tensors["counts"]
    except Exception as e:  # safetensors raises its own error type for a cut-off file
        raise ValueError(f"the checkpoint {path} is corrupt or not a Jacobian lens fit's ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'unreadable'}); it was kept: delete it to start over, "
                         "or pass another out") from None
    check_same_run(meta["identity"], identity, path)
    if len(sums) != n_streams or any(J.shape != (d_model, d_model) or J.dtype != torch.float64 for J in sums) \
            or counts.shape != (2,) or not isinstance(next_index, int):
        raise ValueError(f"the checkpoint {path} does not hold [{d_model}, {d_model}] float64 sums for {n_streams} streams; "
                         "it was kept: delete it to start over, or pass another out")
    return next_index, sums, counts


def finished_fit(cls: type[JacobianLens], out: Path, model: HookedTransformer, identity: dict, rank: int) -> JacobianLens:
    """The lens `out` already holds, when it is this fit's; refused (one line) when it is another's."""
    config = read_config(out)
    if config.get("format") != FORMAT:
        raise ValueError(f"{out} already holds a {config.get('format') or 'non-lens'} folder, not a Jacobian lens fit; "
                         "pass another out")
    check_same_run(config.get("fit_identity", {}), identity, out / CONFIG_FILE)
    if rank == 0:
        print(f"{out}: already fitted ({config.get('estimator', {}).get('n_prompts')} prompts); nothing to do", flush=True)
    return load_folder(cls, out, model)

"""Training a tuned lens: KL(final || lens) against the model's own output, resumable, optionally distributed.

The default recipe is tuned-lens': SGD with Nesterov momentum 0.9, learning rate 1 x (1 - momentum)
decayed linearly to zero, weight decay 1e-3 on (A_l, b_l) (toward the identity, since translators are
residual), gradient norm clipped at 1. Adam (AMSGrad, lr 1e-3, warmup) is an option. A bias-only lens
trains its b_l alone; so does a lens whose weights were frozen by hand (the optimiser gets what requires grad).

Exactness: the windows of step s are a pure function of (seed, s), the learning rate is a function of s,
and a checkpoint holds the translators and the optimiser state, so a run killed at any point (or stopped
with Ctrl-C, which saves a checkpoint of the steps done) and resumed ends with the same weights as one
that never stopped (on the same machine and thread count).

Extending: rerunning into the same `out` with a different `steps` (never fewer than the steps done) and
every other setting the same continues the run to the new total. Step s still reads the same windows, but
the learning rate of the remaining steps follows the schedule re-derived for the new total, and a finished
lens keeps no optimiser state (SGD momentum restarts from zero), so an extended run is NOT identical to a
fresh run of that many steps.

>>> stream = lenskit.io.data.load_token_stream([lenskit.io.data.stdlib_root() / "copy.py"], model.tokenizer)
>>> lens = train(TunedLens(model), stream, Recipe(steps=2, tokens_per_step=512, ctx=256), out="my_lens", progress=False)
>>> lens = train(TunedLens(model), stream, Recipe(steps=2, tokens_per_step=512, ctx=256), out="my_lens", progress=False)
my_lens: already trained (2 steps); nothing to do
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm  # tqdm.auto warns in kernels without ipywidgets

from lenskit import Stream
from lenskit.io.data import TokenStream, window_order
from lenskit.io.files import check_regular_file

from ..io import CONFIG_FILE, read_config, write_atomic
from ..stopping import SaveClock
from ..tuned import TunedLens
from .interrupt import Interrupted, interrupts_between_steps
from .lock import locks_out_folder
from .precision import check_autocast, mixed_precision
from .recipe import Recipe
from .state import check_checkpoint_meta, check_finished_state
from .step import TranslatedStreams, kl_step

CHECKPOINT_FILE = "checkpoint.safetensors"
# Run-identity keys added after runs were first saved, with the value every older run had.
IDENTITY_DEFAULTS = {"bias_only": False}
# Recipe fields added likewise: a run saved before them ran with these values.
RECIPE_DEFAULTS = {"autocast": False}


def make_optimizer(params: list[nn.Parameter], recipe: Recipe) -> torch.optim.Optimizer:
    if recipe.optimizer == "sgd":
        # PyTorch's momentum amplifies the step by 1 / (1 - momentum); lr = 1 - momentum undoes that (tuned-lens).
        return torch.optim.SGD(params, lr=recipe.lr, momentum=recipe.momentum, nesterov=True, weight_decay=recipe.weight_decay)
    return torch.optim.Adam(params, lr=recipe.lr, betas=(recipe.momentum, 0.999), amsgrad=True, weight_decay=recipe.weight_decay)


def stream_label(s: Stream) -> str:
    """How a trained stream is named in logs and `info["stream_labels"]`: "3" for stream 3, "3.mid" for its resid_mid."""
    return str(s.layer) if s.point == "resid_pre" else f"{s.layer}.{s.point.removeprefix('resid_')}"


def collect_streams(lens: TunedLens, tokens: torch.Tensor) -> tuple[list[tuple[Stream, torch.Tensor]], torch.Tensor]:
    """Run the model once without gradients: the streams the lens trains on and the final logits."""
    trained = lens.trained_streams()
    with torch.no_grad():
        logits, cache = lens.model.run_with_cache(tokens, names_filter=[s.hook_name(lens.n_layers) for s in trained])
    return [(s, cache.stream(s)) for s in trained], logits


def distributed() -> tuple[int, int]:
    """(rank, world size): (0, 1) unless torch.distributed is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed() -> tuple[int, int, torch.device | None]:
    """Under torchrun (WORLD_SIZE > 1 in the environment): join the group with NCCL on GPUs, gloo on CPU.

    Returns (rank, world size, the device this rank should use, or None to keep the model's).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        rank, world = distributed()
        return rank, world, None
    cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    device = None
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def finish_distributed() -> None:
    """Leave the torchrun group, once every rank is done: a rank that tore its group down while rank 0 was still
    writing its files could abort at exit in gloo's teardown ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ------------------------------------------------------------- checkpoints
def save_checkpoint(path: Path, lens: TunedLens, opt: torch.optim.Optimizer, meta: dict) -> None:
    tensors = {f"lens.{k}": v.detach().cpu().contiguous() for k, v in lens.state_dict().items()}
    scalars = []
    for i, p in enumerate(lens.parameters()):
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                if value.ndim == 0:
                    scalars.append(f"opt.{i}.{key}")
                tensors[f"opt.{i}.{key}"] = value.detach().cpu().reshape(-1) if value.ndim == 0 else value.detach().cpu().contiguous()
    meta = {**meta, "scalars": scalars}
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata={"meta": json.dumps(meta)}))


def load_checkpoint(path: Path, lens: TunedLens, opt: torch.optim.Optimizer) -> dict:
    """Restore the lens and optimiser state; a truncated or foreign file raises ValueError and is left in place."""
    check_regular_file(path, "a training checkpoint (safetensors)")  # a FIFO would block safe_open
    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {})["meta"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type for a cut-off file
        raise ValueError(f"the checkpoint {path} is corrupt ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'unreadable'}); it was kept. To start over, delete it "
                         f"(or pass another --out)") from None
    check_checkpoint_meta(meta, path)  # field by field, before any is used
    try:
        lens.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("lens.")})
    except Exception as e:  # safetensors raises its own error type for a cut-off file
        raise ValueError(f"the checkpoint {path} is corrupt or does not fit this lens ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'unreadable'}); it was kept. To start over, delete it "
                         f"(or pass another --out)") from None
    device = next(lens.parameters()).device
    for i, p in enumerate(lens.parameters()):
        state = {}
        for name, value in tensors.items():
            prefix = f"opt.{i}."
            if name.startswith(prefix):
                value = value.reshape(()) if name in meta["scalars"] else value
                # Adam keeps its step count on the CPU; moment buffers live with the parameter.
                state[name[len(prefix):]] = value if value.ndim == 0 else value.to(device)
        if state:
            opt.state[p] = state
    return meta


# ------------------------------------------------------------------ train
def saved_recipe(out: Path | None) -> dict:
    """The resolved recipe of the run saved in `out` (its checkpoint, else its finished lens); {} if none is readable."""
    if out is None:
        return {}
    try:
        if (out / CHECKPOINT_FILE).exists():
            saved = checkpoint_identity(out / CHECKPOINT_FILE)["recipe"]
        elif (out / CONFIG_FILE).exists():
            saved = read_config(out)["run_identity"]["recipe"]
        else:
            return {}
    except Exception:  # noqa: BLE001 - unreadable here; resume_or_start reports it with its own message
        return {}
    return saved if isinstance(saved, dict) else {}


def checkpoint_identity(path: Path) -> dict | None:
    """The run identity a checkpoint records, read from its metadata alone; None if it is unreadable."""
    try:
        check_regular_file(path, "a training checkpoint (safetensors)")
        with safe_open(str(path), "pt") as f:
            identity = json.loads((f.metadata() or {})["meta"])["identity"]
    except Exception:  # noqa: BLE001 - a corrupt file: load_checkpoint reports it with its own message
        return None
    return identity if isinstance(identity, dict) else None


def resume_or_start(lens: TunedLens, opt: torch.optim.Optimizer, out: Path | None, identity: dict, recipe: Recipe,
                    rank: int) -> tuple[int, list[list[float]], TunedLens | None]:
    """Where the run starts: (step, loss history, None), from zero, from `out`'s checkpoint (loaded into
    `lens` and `opt`) or from `out`'s finished lens when extending it to more steps (loaded into `lens`,
    fresh optimiser state); or (0, [], the finished lens) when `out` already holds this run's lens."""
    if out is None:
        return 0, [], None
    ckpt = out / CHECKPOINT_FILE
    if ckpt.exists():
        saved = checkpoint_identity(ckpt)
        if saved is not None:  # before loading: another run's lens (bias-only or not) would not even load
            check_same_run(saved, identity, ckpt)
        meta = load_checkpoint(ckpt, lens, opt)
        check_same_run(meta["identity"], identity, ckpt, steps_done=meta["step"])
        if rank == 0:
            print(f"resuming from step {meta['step']} of {recipe.steps} ({ckpt}){extension_note(meta['identity'], recipe)}",
                  flush=True)
        return meta["step"], meta["history"], None
    if (out / CONFIG_FILE).exists():
        done = check_finished_state(read_config(out), out / CONFIG_FILE)
        steps_done = done["steps_done"]
        check_same_run(done.get("run_identity", {}), identity, out / CONFIG_FILE, steps_done=steps_done)
        finished = TunedLens.load(out, lens.model)
        if steps_done == recipe.steps:
            if rank == 0:
                print(f"{out}: already trained ({steps_done} steps); nothing to do", flush=True)
            return 0, [], finished
        lens.load_state_dict(finished.state_dict())
        if rank == 0:
            print(f"extending the finished lens in {out} from {steps_done} to {recipe.steps} steps (fresh optimiser "
                  f"state){extension_note(done['run_identity'], recipe)}", flush=True)
        return steps_done, list(done["loss_history"]), None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    return 0, [], None


def extension_note(saved_identity: dict, recipe: Recipe) -> str:
    before = saved_identity.get("recipe", {}).get("steps")
    if before == recipe.steps:
        return ""
    return (f"; the run was for {before} steps, now {recipe.steps}: the learning-rate schedule is re-derived for "
            f"{recipe.steps} steps, so the result differs from a fresh {recipe.steps}-step run")


def train_step(objective: nn.Module, lens: TunedLens, opt: torch.optim.Optimizer, tokens: torch.Tensor, recipe: Recipe,
               step: int, labels: list[str], world: int, ckpt: Path | None) -> list[float]:
    """One optimiser step on this rank's windows `tokens` [n, ctx]; returns the step's KL per stream (nats per token)."""
    step_loss = torch.zeros(len(labels) + 1, dtype=torch.float64, device=tokens.device)  # + non-finite final flags
    chunks = tokens.split(max(1, recipe.micro_batch_tokens // recipe.ctx))
    for i, chunk in enumerate(chunks):
        with mixed_precision(recipe, tokens.device):
            streams, final = collect_streams(lens, chunk)
        # DDP all-reduces gradients on the last micro-batch only; no_sync must cover forward and backward.
        accumulate = world > 1 and i < len(chunks) - 1
        with objective.no_sync() if accumulate else contextlib.nullcontext():
            # Forward and backward: [n_streams] summed nats, gradients added. Each rank divides by the step's
            # total tokens and DDP averages over ranks, so the gradient is the mean over every token of the
            # step: identical maths to one process doing all of it.
            with mixed_precision(recipe, tokens.device):
                per_stream = kl_step(objective, lens.model.readout, streams, final, world / recipe.tokens_per_step)
            step_loss += loss_record(per_stream, final, world)
    norm = torch.nn.utils.clip_grad_norm_(lens.parameters(), recipe.clip_grad_norm)
    # The step's one device -> host copy (on a GPU, its one synchronisation): losses, NaN count and gradient norm.
    logged = torch.cat([step_loss, norm.double().reshape(1)]).cpu()
    check_finite(logged[:-1], labels, step, ckpt)
    if not torch.isfinite(logged[-1]):
        raise FloatingPointError(non_finite_message("gradient norm", step, labels, ckpt))
    step_loss = logged[:-2]
    for group in opt.param_groups:
        group["lr"] = recipe.lr_at(step)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return [round(float(x), 6) for x in step_loss / recipe.tokens_per_step]


@locks_out_folder  # one run per --out: a second one refuses (lenses/training/lock.py)
def train(lens: TunedLens, stream: TokenStream, recipe: Recipe = Recipe(), out: str | os.PathLike | None = None,
          progress: bool = True) -> TunedLens:
    """Train `lens` in place on `stream` and return it; with `out`, checkpoint there, resume from there,
    and save the finished lens there (config.json + lens.safetensors + README.md). With `out` holding a run
    of the same settings but another `steps`, continue it to the new total (see the module docstring).
    Ctrl-C (or SIGTERM, SIGHUP, SIGUSR1) raises `Interrupted` after checkpointing the steps done.

    Under torch.distributed (e.g. torchrun) every rank calls this with the same data; each takes its share
    of every step's windows, DistributedDataParallel averages the gradients, and rank 0 writes the files.
    Raises FloatingPointError on a NaN or inf loss, leaving the last checkpoint as it was.
    """
    rank, world = distributed()
    model = lens.model
    out = Path(out) if out is not None else None
    recipe = recipe.continuing(saved_recipe(out)).resolve(len(stream), model.cfg.n_ctx, world)
    windows = stream.windows(recipe.ctx)  # [n_windows, ctx]
    per_step = recipe.tokens_per_step // recipe.ctx
    order = window_order(len(windows), recipe.seed)
    labels = [stream_label(s) for s in lens.trained_streams()]
    check_autocast(recipe, next(lens.parameters()).device)  # before any work
    identity = {"recipe": recipe.identity(), "data_sha256": stream.provenance.get("sha256"), "model_fingerprint": lens.fingerprint,
                "resid_mid": lens.has_mid, "bias_only": lens.bias_only, "world_size": world}

    ckpt = out / CHECKPOINT_FILE if out is not None else None
    # Only what trains: a weight frozen by hand (requires_grad False) gets no update, no decay and no state.
    opt = make_optimizer([p for p in lens.parameters() if p.requires_grad], recipe)
    step, history, finished = resume_or_start(lens, opt, out, identity, recipe, rank)
    if finished is not None:
        return finished

    device = next(lens.parameters()).device
    objective = TranslatedStreams(lens)
    if world > 1:
        # gloo wants no device_ids; NCCL wants this rank's GPU.
        objective = nn.parallel.DistributedDataParallel(objective, device_ids=[device] if device.type == "cuda" else None)
    frozen = [p for p in model.parameters() if p.requires_grad]
    bar = tqdm(total=recipe.steps, initial=step, desc="tuned lens", dynamic_ncols=True, disable=not progress or rank != 0)
    was_training = model.training
    model.eval()
    try:
        for p in frozen:  # the model is only read: no gradients for its weights (the unembedding would get some)
            p.requires_grad_(False)
        clock = SaveClock(recipe.ckpt_minutes)
        with interrupts_between_steps(opt) as guard:
            while step < recipe.steps:
                if guard.requested.is_set():  # Ctrl-C: keep the whole steps done, then stop
                    if ckpt is not None and rank == 0:
                        save_checkpoint(ckpt, lens, opt, {"step": step, "history": history, "identity": identity})
                    raise Interrupted(step, ckpt)
                ids = order[step * per_step: (step + 1) * per_step][rank::world]  # this rank's share of the step
                try:
                    guard.interruptible = True  # until opt.step starts (its pre-hook clears it)
                    losses = train_step(objective, lens, opt, windows[ids].to(device), recipe, step, labels, world, ckpt)
                except KeyboardInterrupt:  # before opt.step: the weights are still those after `step` steps
                    guard.interruptible = False
                    guard.requested.set()  # also a KeyboardInterrupt raised some other way
                    opt.zero_grad(set_to_none=True)
                    continue
                guard.interruptible = False
                history.append(losses)
                step += 1
                bar.update(1)
                bar.set_postfix_str("KL/layer " + " ".join(f"{x:.3g}" for x in history[-1]))
                # By time too, in one process (ranks' clocks would disagree on when, and they save together).
                if ckpt is not None and (step % recipe.ckpt_every == 0 or step == recipe.steps or world == 1 and clock.due()):
                    if rank == 0:
                        save_checkpoint(ckpt, lens, opt, {"step": step, "history": history, "identity": identity})
                        clock.saved()
                    if world > 1:
                        dist.barrier()
    finally:
        bar.close()
        for p in frozen:
            p.requires_grad_(True)
        model.train(was_training)

    lens.info = {
        "recipe": recipe.identity(), "steps_done": step, "tokens_seen": step * recipe.tokens_per_step,
        "stream_labels": labels, "loss_history": history, "data": stream.provenance, "run_identity": identity,
    }
    if out is not None and rank == 0:
        lens.save(out)
        ckpt.unlink(missing_ok=True)  # the finished lens replaces it; the folder is config.json + one .safetensors
    if world > 1:
        dist.barrier()
    return lens


def loss_record(per_stream: torch.Tensor, final: torch.Tensor, world: int) -> torch.Tensor:
    """The per-stream loss sums, then 1 if any final logit is NaN or infinite (a NaN target can hide inside a
    KL), else 0: [n + 1] float64, summed over ranks; on the device, without waiting for it."""
    # min and max propagate NaN and show an infinity: one pass with no temporary, where counting
    # `~isfinite(final)` took several passes and an int64 copy of the logits (a tenth of a step on the CPU).
    low, high = torch.aminmax(final)
    bad = ~(torch.isfinite(low) & torch.isfinite(high))
    logged = torch.cat([per_stream.detach().double(), bad.double().reshape(1)])
    if world > 1:
        dist.all_reduce(logged)  # every rank sees a NaN anywhere, so all stop together
    return logged


def check_finite(logged: torch.Tensor, labels: list[str], step: int, ckpt: Path | None) -> None:
    """FloatingPointError (on every rank alike) if a `loss_record` sum, on the host, holds a NaN/inf."""
    if logged[-1] > 0:
        raise FloatingPointError(non_finite_message("model's own output", step, ["final"], ckpt))
    if not torch.isfinite(logged).all():
        bad = [labels[j] for j in range(len(labels)) if not torch.isfinite(logged[j])]
        raise FloatingPointError(non_finite_message("loss", step, bad, ckpt))


def short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 24 else text[:20] + "..."


def check_same_run(saved: dict, current: dict, where: Path, steps_done: object = None) -> None:
    """Refuse, in one short line naming each field that differs, unless `current` continues the `saved` run:
    every setting the same, except `steps`, which may change but not below the steps done."""
    diffs = []
    for key, now in current.items():
        then = saved.get(key, IDENTITY_DEFAULTS.get(key))
        if key == "recipe" and isinstance(then, dict) and isinstance(now, dict):
            diffs += [f"{f} (saved {short(then.get(f, RECIPE_DEFAULTS.get(f)))}, now {short(v)})" for f, v in now.items()
                      if f != "steps" and then.get(f, RECIPE_DEFAULTS.get(f)) != v]
        elif then != now:
            diffs.append(f"{key} (saved {short(then)}, now {short(now)})")
    if diffs:
        raise ValueError(f"{where} belongs to a different run: {'; '.join(diffs)} differ; rerun with the same settings "
                         "to resume or extend it, or pass another --out")
    steps = current.get("recipe", {}).get("steps") if isinstance(current.get("recipe"), dict) else None
    if isinstance(steps_done, int) and isinstance(steps, int) and steps < steps_done:
        raise ValueError(f"{where} has {steps_done} steps done, more than --steps {steps}; pass --steps {steps_done} "
                         "or more to resume or extend it, or pass another --out")


def non_finite_message(what: str, step: int, streams: list[str], ckpt: Path | None) -> str:
    kept = f"the last good checkpoint in {ckpt} is intact" if ckpt is not None and ckpt.exists() else "no checkpoint was written"
    return (f"the {what} is NaN or inf at step {step} (streams {', '.join(streams)}); training stopped and {kept}. "
            "Try a lower learning rate or check the data and the model's dtype")

"""`lenskit train-sae`: a small TopK sparse autoencoder trained on a `lenskit cache` export.

The recipe is Gao et al.'s (2024) TopK SAE: f = TopK(relu((x - b_dec) W_enc + b_enc)), x_hat = f W_dec + b_dec,
decoder rows kept at unit norm (the gradient along each row removed before the step), W_enc initialised as W_dec's
transpose, b_dec at the data's mean, and the AuxK loss: the k_aux largest pre-activations of the dead latents
(none fired in the last `dead_tokens` tokens) reconstruct the main reconstruction's error, weighted `aux_weight`.
Inputs are scaled so that E||x||^2 = d_in during training; the scale is folded into the saved weights, so the
SAE reads the model's own activations.

Windows of the export (its last `eval_windows` held out) are read whole, in an order fixed by the seed; a
checkpoint in `--out` (weights, Adam's moments, the step) lets a rerun of the same command resume, with the same
numbers as an uninterrupted run. The folder ends as SAELens's layout (`cfg.json`, `sae_weights.safetensors`)
plus `training.json` and a README.md card: tokens, MSE, FVU, L0, dead fraction, and the CE increase when spliced.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lenskit.io.activations import ActivationDataset
from lenskit.io.data import portable_path
from lenskit.saes import SAE, SAEConfig

from .io import default_file_mode

CHECKPOINT = "checkpoint.safetensors"
CHECKPOINT_EVERY = 200  # steps
STATE = "checkpoint.json"


@dataclass(frozen=True)
class SAERecipe:
    latents: int = 1536
    k: int = 32
    tokens: int = 0  # 0: one pass over the training windows
    batch_windows: int = 16
    lr: float = 4e-4
    aux_weight: float = 1 / 32
    dead_tokens: int = 200_000
    eval_windows: int = 32
    seed: int = 0


def _windows(rows: ActivationDataset, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    acts, toks = zip(*(rows.window(int(w)) for w in idx))
    return torch.cat(acts).float(), torch.stack(toks)


class _Trainer:
    def __init__(self, rows: ActivationDataset, recipe: SAERecipe, out: Path, device: torch.device) -> None:
        self.rows, self.r, self.out, self.device = rows, recipe, out, device
        n = len(rows) // rows.ctx
        if n <= recipe.eval_windows + recipe.batch_windows:
            raise ValueError(f"{rows.folder} holds {n} windows; train-sae needs more than {recipe.eval_windows} held out "
                             f"plus one batch of {recipe.batch_windows}")
        self.eval_idx = torch.arange(n - recipe.eval_windows, n)
        order = torch.randperm(n - recipe.eval_windows, generator=torch.Generator().manual_seed(recipe.seed))
        per_pass = len(order) // recipe.batch_windows
        steps = per_pass if recipe.tokens <= 0 else math.ceil(recipe.tokens / (recipe.batch_windows * rows.ctx))
        passes = math.ceil(steps / per_pass)
        gen = torch.Generator().manual_seed(recipe.seed + 1)
        self.order = torch.cat([order] + [order[torch.randperm(len(order), generator=gen)] for _ in range(passes - 1)])
        self.steps = steps
        d = rows.shape[-1]
        self.d = d
        if recipe.latents < recipe.k or recipe.k < 1:
            raise ValueError(f"--k must be in 1..--latents; got k={recipe.k}, latents={recipe.latents}")

    def init(self) -> dict[str, torch.Tensor]:
        d, m = self.d, self.r.latents
        x, _ = _windows(self.rows, self.order[: self.r.batch_windows * 4])
        scale = math.sqrt(d / float(x.pow(2).sum(-1).mean()))
        g = torch.Generator().manual_seed(self.r.seed)
        W_dec = torch.randn(m, d, generator=g)
        W_dec /= W_dec.norm(dim=-1, keepdim=True)
        return {"W_enc": W_dec.T.contiguous(), "b_enc": torch.zeros(m), "W_dec": W_dec, "b_dec": (x * scale).mean(0),
                "scale": torch.tensor(scale), "last_fired": torch.zeros(m)}

    def run(self, progress: bool = True) -> dict[str, torch.Tensor]:
        ck = self.out / CHECKPOINT
        state = {n: t.to(self.device) for n, t in (load_file(str(ck)) if ck.is_file() else self.init()).items()}
        meta = json.loads((self.out / STATE).read_text()) if ck.is_file() else {"step": 0, "recipe": asdict(self.r)}
        if meta["recipe"] != asdict(self.r):
            raise ValueError(f"{self.out} holds a checkpoint of another recipe ({meta['recipe']}); use a new --out "
                             "or the same options")
        params = {n: torch.nn.Parameter(state[n]) for n in ("W_enc", "b_enc", "W_dec", "b_dec")}
        opt = torch.optim.Adam(params.values(), lr=self.r.lr, betas=(0.9, 0.999), eps=6.25e-10)
        if "adam_step" in state:
            for i, p in enumerate(params.values()):
                opt.state[p] = {"step": state["adam_step"].clone(), "exp_avg": state[f"m{i}"], "exp_avg_sq": state[f"v{i}"]}
        scale, last_fired = float(state["scale"]), state["last_fired"]
        bw = self.r.batch_windows
        t0, step = time.time(), meta["step"]
        while step < self.steps:
            x, _ = _windows(self.rows, self.order[step * bw : (step + 1) * bw])
            x = x.to(self.device) * scale
            pre = (x - params["b_dec"]) @ params["W_enc"] + params["b_enc"]
            top = pre.topk(self.r.k, dim=-1)
            f = torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))
            x_hat = f @ params["W_dec"] + params["b_dec"]
            err = x - x_hat
            total = (x - x.mean(0)).pow(2).sum()
            loss = err.pow(2).sum() / total
            last_fired += len(x)
            last_fired[top.indices[top.values > 0].unique()] = 0
            dead = last_fired >= self.r.dead_tokens
            # AuxK: the dead latents' top k_aux pre-activations model the error. Computed every step and weighted by
            # whether any latent is dead, so the loop never waits on the device: live latents enter as relu(-inf) = 0,
            # so this adds exactly 0 (value and gradient) when none is dead, as skipping it would.
            aux = torch.where(dead, pre, -torch.inf).topk(min(self.d // 2, self.r.latents), dim=-1)
            e_hat = torch.zeros_like(pre).scatter(-1, aux.indices, torch.relu(aux.values)) @ params["W_dec"]
            loss = loss + dead.any() * (self.r.aux_weight * (e_hat - err.detach()).pow(2).sum() / total)
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                W, G = params["W_dec"], params["W_dec"].grad
                G -= (G * W).sum(-1, keepdim=True) * W  # no step along a row: its norm stays 1
                opt.step()
                W /= W.norm(dim=-1, keepdim=True)
            step += 1
            if progress and (step % 50 == 0 or step == self.steps):
                print(f"step {step}/{self.steps}  fvu {float(err.detach().pow(2).sum() / total):.4f}  dead {float(dead.float().mean()):.3f}"
                      f"  {time.time() - t0:.0f}s", flush=True)
            if step % CHECKPOINT_EVERY == 0 or step == self.steps:
                self._checkpoint(params, opt, scale, last_fired, step)
        return {n: p.detach().cpu() for n, p in params.items()} | {"scale": torch.tensor(scale)}

    def _checkpoint(self, params, opt, scale, last_fired, step) -> None:
        state = {n: p.detach().cpu().contiguous().clone() for n, p in params.items()}
        state.update(scale=torch.tensor(scale), last_fired=last_fired.cpu().clone())
        for i, p in enumerate(params.values()):
            s = opt.state[p]
            state.update({f"m{i}": s["exp_avg"].cpu().clone(), f"v{i}": s["exp_avg_sq"].cpu().clone()})
            state["adam_step"] = torch.as_tensor(s["step"]).cpu().clone()
        tmp = self.out / (CHECKPOINT + ".tmp")
        save_file(state, str(tmp))
        (self.out / (STATE + ".tmp")).write_text(json.dumps({"step": step, "recipe": asdict(self.r)}))
        tmp.replace(self.out / CHECKPOINT)
        (self.out / (STATE + ".tmp")).replace(self.out / STATE)


def short_model_name(name: Any) -> str | None:
    """An embedded model's folder as its short name (`stdlib-gpt2`), so that the card does not name a local path."""
    import lenskit

    if not isinstance(name, str):
        return None
    here = Path(name).expanduser().resolve()
    return next((short for short, folder in lenskit.EMBEDDED_MODELS.items() if Path(folder).resolve() == here), name)


def folded_sae(w: dict[str, torch.Tensor], hook: str, k: int, model_name: str | None) -> SAE:
    """The SAE on the model's own scale: training saw c * x, so W_enc * c, W_dec / c and b_dec / c."""
    c = float(w["scale"])
    d, m = w["W_enc"].shape
    cfg = SAEConfig(d_in=d, d_sae=m, architecture="topk", k=k, hook_name=hook, apply_b_dec_to_input=True,
                    format="lenskit", source="lenskit train-sae", model_name=model_name)
    return SAE(cfg, {"W_enc": w["W_enc"] * c, "b_enc": w["b_enc"], "W_dec": w["W_dec"] / c, "b_dec": w["b_dec"] / c})


@torch.no_grad()
def evaluate_sae(sae: SAE, rows: ActivationDataset, windows: torch.Tensor, model=None) -> dict[str, Any]:
    """MSE, FVU, L0 and dead fraction on `windows` of the export; with the model, its next-token CE on their
    tokens plain and with the SAE spliced in without the error term (nats per token)."""
    x, toks = _windows(rows, windows)
    f = sae.encode(x)
    x_hat = sae.decode(f)
    out = {"tokens": len(x), "mse": float((x - x_hat).pow(2).mean()),
           "fvu": float((x - x_hat).pow(2).sum() / (x - x.mean(0)).pow(2).sum()),
           "l0": float((f > 0).sum(-1).float().mean()), "dead_fraction": float(((f > 0).sum(0) == 0).float().mean())}
    if model is not None:
        ce = float(model(toks, return_type="loss"))
        spliced = float(model.run_with_saes(toks, saes=[sae], use_error_term=False, return_type="loss"))
        out.update(ce_clean=ce, ce_spliced=spliced, ce_increase=spliced - ce)
    return out


def card(meta: dict[str, Any]) -> str:
    ev, r = meta["eval"], meta["recipe"]
    lines = ["---", "library_name: lenskit", "tags:", "- sparse-autoencoder", "- saelens", "- lenskit", "---", "",
             f"# TopK SAE on {meta['model_name']}'s `{meta['hook']}`", "",
             f"{r['latents']} latents, k = {r['k']}, trained by `lenskit train-sae` on {meta['training_tokens']:,} "
             f"tokens of the export in `{meta['activations']}` (AuxK weight {r['aux_weight']:g}, lr {r['lr']:g}, "
             f"seed {r['seed']}). Files in SAELens's layout: `cfg.json` and `sae_weights.safetensors`.", "",
             *([f"Data: {meta['data']}.", ""] if meta.get("data") else []),
             "```python", "from lenskit.saes import SAE", "sae = SAE.load(\"<this folder>\")", "```", "",
             f"Held-out evaluation on {ev['tokens']:,} tokens (the export's last {r['eval_windows']} windows, never trained on):", "",
             "| metric | value |", "|---|---|",
             f"| MSE (per element) | {ev['mse']:.5g} |", f"| FVU (fraction of variance unexplained) | {ev['fvu']:.4f} |",
             f"| L0 (active latents per token) | {ev['l0']:.2f} |", f"| dead fraction (never active here) | {ev['dead_fraction']:.4f} |"]
    if "ce_increase" in ev:
        lines += [f"| CE clean (nats/token) | {ev['ce_clean']:.4f} |", f"| CE spliced, no error term | {ev['ce_spliced']:.4f} |",
                  f"| CE increase when spliced | {ev['ce_increase']:.4f} |"]
    return "\n".join(lines) + "\n"


def train_sae(activations: str | Path, hook: str | None, out: str | Path, recipe: SAERecipe = SAERecipe(),
              model=None, progress: bool = True, device: str | torch.device = "cpu") -> SAE:
    """Train (or resume) a TopK SAE on one hook of a `lenskit cache` export; write it, its metrics and its card to
    `out`. `model` (the export's model) adds the CE increase when spliced. The SAE trains on `device`."""
    rows = ActivationDataset(activations, hook)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = _Trainer(rows, recipe, out, torch.device(device))
    weights = trainer.run(progress)
    sae = folded_sae(weights, rows.hook, recipe.k, short_model_name(rows.manifest.get("model_name")))
    meta = {"hook": rows.hook, "model_name": sae.cfg.model_name or "the model", "activations": portable_path(Path(activations), activations),
            "training_tokens": trainer.steps * recipe.batch_windows * rows.ctx, "recipe": asdict(recipe),
            "eval": evaluate_sae(sae, rows, trainer.eval_idx, model)}
    sae.save(out, {"training_tokens": meta["training_tokens"], "trained_with": "lenskit train-sae"})
    os.chmod(out / "sae_weights.safetensors", default_file_mode())  # safetensors writes 0600; a model repo is shared
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "README.md").write_text(card(meta))
    return sae

"""Writers of small SAE files in each published format, for the SAE tests (random weights, fixed seeds)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file


def rand(*shape: int, seed: int = 0, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def saelens_folder(folder: Path, d_in: int, d_sae: int, arch: str = "standard", hook: str = "blocks.1.hook_resid_pre",
                   v6: bool = True, **cfg_extra) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    w = {"W_enc": rand(d_in, d_sae, seed=1), "W_dec": rand(d_sae, d_in, seed=2), "b_dec": rand(d_in, seed=3)}
    if arch == "gated":
        w.update(b_gate=rand(d_sae, seed=4), r_mag=rand(d_sae, seed=5), b_mag=rand(d_sae, seed=6))
    else:
        w["b_enc"] = rand(d_sae, seed=4)
    if arch == "jumprelu":
        w["threshold"] = rand(d_sae, seed=7).abs() * 0.5
    cfg = {"architecture": arch, "d_in": d_in, "d_sae": d_sae, "apply_b_dec_to_input": True,
           "normalize_activations": "none", "dtype": "float32", "device": "cpu", **cfg_extra}
    if v6:
        cfg["metadata"] = {"hook_name": hook, "model_name": "tiny"}
    else:
        cfg["hook_name"] = hook
    save_file(w, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return w


def gemma_scope_npz(path: Path, d_in: int, d_sae: int) -> dict[str, torch.Tensor]:
    path.parent.mkdir(parents=True, exist_ok=True)
    w = {"W_enc": rand(d_in, d_sae, seed=1), "W_dec": rand(d_sae, d_in, seed=2), "b_enc": rand(d_sae, seed=3),
         "b_dec": rand(d_in, seed=4), "threshold": rand(d_sae, seed=5).abs() * 0.3}
    np.savez(path, **{k: v.numpy() for k, v in w.items()})
    return w


def sparsify_folder(folder: Path, d_in: int, d_sae: int, k: int, transcode: bool = False, skip: bool = False):
    folder.mkdir(parents=True, exist_ok=True)
    w = {"encoder.weight": rand(d_sae, d_in, seed=1), "encoder.bias": rand(d_sae, seed=2), "W_dec": rand(d_sae, d_in, seed=3),
         "b_dec": rand(d_in, seed=4)}
    if skip:
        w["W_skip"] = rand(d_in, d_in, seed=5)
    save_file(w, str(folder / "sae.safetensors"))
    (folder / "cfg.json").write_text(json.dumps({"d_in": d_in, "num_latents": d_sae, "k": k, "activation": "topk",
                                                  "transcode": transcode, "skip_connection": skip}))
    return w


def circuit_tracer_file(path: Path, d_in: int, d_sae: int, skip: bool = True) -> dict[str, torch.Tensor]:
    path.parent.mkdir(parents=True, exist_ok=True)
    w = {"W_enc": rand(d_sae, d_in, seed=1), "W_dec": rand(d_sae, d_in, seed=2), "b_enc": rand(d_sae, seed=3),
         "b_dec": rand(d_in, seed=4), "activation_function.threshold": rand(d_sae, seed=5).abs() * 0.3}
    if skip:
        w["W_skip"] = rand(d_in, d_in, seed=6)
    save_file(w, str(path))
    return w


def dictionary_learning_pt(path: Path, d_in: int, d_sae: int, topk: int | None = None) -> dict[str, torch.Tensor]:
    path.parent.mkdir(parents=True, exist_ok=True)
    w = {"encoder.weight": rand(d_sae, d_in, seed=1), "encoder.bias": rand(d_sae, seed=2),
         "decoder.weight": rand(d_in, d_sae, seed=3)}
    if topk is None:
        w["bias"] = rand(d_in, seed=4)
    else:
        w.update(b_dec=rand(d_in, seed=4), k=torch.tensor(topk))
    torch.save(w, path)
    return w

"""Jacobian lens files: lenskit's lens folder, and the reference implementation's `.pt` dict, both ways.

A lens folder is `config.json` (format "lenskit-jacobian-lens": model fingerprint, family, shape, fitted streams,
estimator settings, data provenance) + `lens.safetensors` (`J.{stream}`) + a `README.md` card, like a tuned lens.

The reference file (anthropics/jacobian-lens, and TransformerLens 4's `JacobianLens.save`) is a `torch.save`d dict

    {"J": {layer: [d_model, d_model]}, "n_prompts": int, "source_layers": [layer, ...], "d_model": int, "metadata": {...}}

with layer l the output of block l, our stream l + 1: our stream 0 (the embeddings) has no place in it and is left
out. A reference fit checkpoint (`jacobian_sum`: running sums, `n_done`: prompts summed) loads too. Such files are
read with `lenskit.io.torchfile.read_plain_torch_file` (archive checks, then `torch.load(weights_only=True)`) only,
so a file holding anything but tensors and plain values is refused before any of it runs; then every key, type,
shape and value is checked against the model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from lenskit import HookedTransformer
from lenskit.io.hub import resolve_hub_file, resolve_model_folder
from lenskit.io.torchfile import read_plain_torch_file

from .card import CARD_FILE, check_eval, model_card
from .card import JACOBIAN_FORMAT as FORMAT
from .io import CONFIG_FILE, read_config, write_atomic
from .tuned import FINGERPRINT, REDUCED_DTYPES, check_fingerprint, check_shape, model_fingerprint, read_weights

if TYPE_CHECKING:
    from .jacobian import JacobianLens

FORMAT_VERSION = 1
WEIGHTS_FILE = "lens.safetensors"

# config.json keys that describe the lens itself; the rest (estimator, data, fit_identity, ...) is `JacobianLens.info`.
STRUCTURE_KEYS = ("format", "format_version", "model_fingerprint", "model_name", "family", "model_dtype",
                  "model_fingerprints_reduced", "n_layers", "d_model", "d_vocab", "streams", "weights")
REFERENCE_ESTIMATOR = "jacobian_lens"  # what TransformerLens records as metadata["estimator"]


# ------------------------------------------------------------------ lens folders
# How to get a Jacobian lens for another model, where check_fingerprint refuses one.
JACOBIAN_REMEDY = "fit a new Jacobian lens on this model with `JacobianLens.fit(model, tokens)`"


def folder_config(lens: JacobianLens) -> dict[str, Any]:
    cfg = lens.model.cfg
    model_dtype = lens.model.unembed.weight.dtype
    reduced = {}
    if model_dtype == torch.float32:  # a float32-fitted lens also loads on the same model in bf16 / fp16
        reduced = {name: model_fingerprint(lens.model, dtype) for name, dtype in REDUCED_DTYPES.items()}
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "model_fingerprint": lens.fingerprint, "model_name": cfg.name,
        "family": cfg.family, "model_dtype": str(model_dtype).removeprefix("torch."), "model_fingerprints_reduced": reduced,
        "n_layers": cfg.n_layers, "d_model": cfg.d_model, "d_vocab": cfg.d_vocab, "streams": lens.streams,
        "weights": WEIGHTS_FILE, **lens.info,
    }


def save_folder(lens: JacobianLens, folder: str | os.PathLike) -> Path:
    from .training.lock import folder_lock  # one writer per lens folder, as TunedLens.save

    folder = Path(folder)
    with folder_lock(folder, join=True):
        _write_folder(lens, folder)
    return folder


def _write_folder(lens: JacobianLens, folder: Path) -> None:
    tensors = {f"J.{s}": lens.matrix(s).detach().cpu().contiguous() for s in lens.streams}
    write_atomic(folder / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": FORMAT}))
    config = folder_config(lens)
    text = json.dumps(config, indent=2) + "\n"
    write_atomic(folder / CONFIG_FILE, lambda tmp: tmp.write_text(text))
    card = model_card(config)
    write_atomic(folder / CARD_FILE, lambda tmp: tmp.write_text(card, encoding="utf-8"))


def load_folder(cls: type[JacobianLens], folder: Path, model: HookedTransformer) -> JacobianLens:
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {folder}; expected a Jacobian lens folder written by JacobianLens.save "
                                "(for a reference .pt, pass the file, or filename=)")
    config = read_config(folder)
    where = folder / CONFIG_FILE
    if config.get("format") != FORMAT:
        raise ValueError(f"{where} is not a Jacobian lens (format {config.get('format')!r}, expected {FORMAT!r}); "
                         "load it with the class its format names (lenses.spec.load_lens reads any)")
    check_folder_config(config, where, model)
    check_shape(config, model, folder)
    check_fingerprint(config, model, folder, remedy=JACOBIAN_REMEDY)
    check_eval(config, where)
    weights = folder / config["weights"]
    state = read_weights(weights)
    wanted = {f"J.{s}" for s in config["streams"]}
    if set(state) != wanted:
        missing, extra = sorted(wanted - set(state)), sorted(set(state) - wanted)
        raise ValueError(f"{weights} does not match its config's streams: missing {missing[:4]}, unexpected {extra[:4]}; "
                         "save the lens again")
    matrices = {s: checked_matrix(state[f"J.{s}"], f"{weights}: J.{s}", model.cfg.d_model) for s in config["streams"]}
    return cls(model, matrices, info={k: v for k, v in config.items() if k not in STRUCTURE_KEYS})


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_folder_config(config: dict, where: Path, model: HookedTransformer) -> None:
    """Types of the structural keys, then the family: one line naming the file and the field."""
    version = config.get("format_version")
    if not _is_int(version) or version > FORMAT_VERSION:
        raise ValueError(f"{where}: format_version {json.dumps(version)} is not one this lenskit reads (1..{FORMAT_VERSION}); "
                         "upgrade lenskit or save the lens again")
    n = config.get("n_layers")
    checks = {
        "model_fingerprint": (lambda v: isinstance(v, str) and FINGERPRINT.fullmatch(v) is not None, "'<family>:sha256:<hex>'"),
        "family": (lambda v: isinstance(v, str) and v != "", "a model family name"),
        "n_layers": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
        "d_model": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
        "streams": (lambda v: isinstance(v, list) and v and all(_is_int(s) and 0 <= s < n for s in v) and len(set(v)) == len(v),
                    "a non-empty list of distinct streams in 0..n_layers-1"),
        "weights": (lambda v: isinstance(v, str) and v.endswith(".safetensors") and Path(v).name == v,
                    "the name of a .safetensors file in the folder"),
    }
    for key, (ok, want) in checks.items():
        if key not in config:
            raise ValueError(f"{where} has no {key!r}; a Jacobian lens config needs it (save the lens again)")
        if not ok(config[key]):
            raise ValueError(f"{where}: {key!r} must be {want}, got {json.dumps(config[key])[:80]}")
    if config["family"] != model.cfg.family:
        raise ValueError(f"the Jacobian lens in {where.parent} was fitted on a {config['family']} model "
                         f"({config.get('model_name')!r}), but this model is {model.cfg.family} ({model.cfg.name!r}); "
                         "load the model the lens was fitted for")


def checked_matrix(J: object, what: str, d_model: int) -> torch.Tensor:
    """A [d_model, d_model] floating, finite tensor, or a one-line ValueError naming `what`."""
    if not isinstance(J, torch.Tensor):
        raise ValueError(f"{what} holds a {type(J).__name__}, expected a [{d_model}, {d_model}] tensor")
    if J.shape != (d_model, d_model):
        raise ValueError(f"{what} has shape {tuple(J.shape)}, expected ({d_model}, {d_model}) for this model's d_model={d_model}")
    if not J.dtype.is_floating_point:
        raise ValueError(f"{what} has dtype {J.dtype}; a Jacobian matrix must be floating point")
    if not bool(torch.isfinite(J).all()):
        raise ValueError(f"{what} holds NaN or inf values; the lens is corrupt or its fit diverged")
    return J


# ------------------------------------------------------------------ reference .pt
def save_reference(lens: JacobianLens, path: str | os.PathLike, dtype: torch.dtype = torch.float16) -> Path:
    path = Path(path)
    kept = [s for s in lens.streams if s >= 1]  # stream 0, the embeddings, is no block's output
    if not kept:
        raise ValueError("this lens holds stream 0 only, which the reference format (block outputs) cannot hold; "
                         "save it as a lens folder with lens.save(folder)")
    estimator = lens.info.get("estimator") if isinstance(lens.info.get("estimator"), dict) else {}
    cfg = lens.model.cfg
    provenance = {k: v for k, v in folder_config(lens).items() if k not in ("weights", "streams")}
    metadata = {"estimator": REFERENCE_ESTIMATOR, "target_layer": cfg.n_layers - 1,
                **{k: estimator[k] for k in ("n_prompts", "skip_first_positions") if k in estimator},
                "lenskit": json.loads(json.dumps(provenance))}  # plain values only, as weights_only reads them
    payload = {"J": {s - 1: lens.matrix(s).detach().cpu().to(dtype) for s in kept},
               "n_prompts": int(estimator.get("n_prompts") or 0), "source_layers": [s - 1 for s in kept],
               "d_model": cfg.d_model, "metadata": metadata}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: torch.save(payload, tmp))
    return path


def read_reference(cls: type[JacobianLens], path: Path, model: HookedTransformer) -> JacobianLens:
    """A reference `.pt` (lens or fit checkpoint) onto `model`; see the module docstring."""
    payload = read_plain_torch_file(path, what="a Jacobian lens .pt (torch.save of tensors and plain values)")
    check_plain(payload, str(path))
    if not isinstance(payload, dict) or not ("J" in payload or "jacobian_sum" in payload):
        raise ValueError(f"{path} is not a Jacobian lens: expected a dict with 'J' (a lens) or 'jacobian_sum' and 'n_done' "
                         f"(a fit checkpoint), found {list(payload)[:6] if isinstance(payload, dict) else type(payload).__name__}")
    n, d = model.cfg.n_layers, model.cfg.d_model
    checkpoint = "J" not in payload
    count_key = "n_done" if checkpoint else "n_prompts"
    count = payload.get(count_key, 0)
    if not _is_int(count) or count < (1 if checkpoint else 0):
        raise ValueError(f"{path}: {count_key!r} must be an integer >= {1 if checkpoint else 0}, got {count!r}")
    if "d_model" in payload and payload["d_model"] != d:
        raise ValueError(f"{path} holds a lens for d_model={payload.get('d_model')!r}, but the model has d_model={d}; "
                         "load the model the lens was fitted for")
    metadata = payload.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: 'metadata' holds a {type(metadata).__name__}, expected a dict of plain values")
    target = payload.get("target_layer", metadata.get("target_layer", n - 1))
    if target != n - 1:
        raise ValueError(f"{path} maps layer {target!r} to the output, but a lens reads through the last block ({n - 1}) "
                         f"of this {n}-block model; refit it with the default target")
    J = payload["jacobian_sum" if checkpoint else "J"]
    if not isinstance(J, dict) or not J:
        raise ValueError(f"{path}: {'jacobian_sum' if checkpoint else 'J'} must be a non-empty dict {{layer: matrix}}")
    bad = [l for l in J if not _is_int(l) or not 0 <= l < n - 1]
    if bad:
        raise ValueError(f"{path} has layer(s) {bad[:4]}, but this {n}-block model's source layers (block outputs before "
                         f"the last) are 0..{n - 2}: the lens belongs to another model")
    listed = payload.get("source_layers", sorted(J))
    if not isinstance(listed, (list, tuple)) or list(listed) != sorted(J):
        raise ValueError(f"{path}: source_layers {str(listed)[:60]} do not match the layers of its matrices {sorted(J)[:8]}")
    lenskit = metadata.get("lenskit")
    if isinstance(lenskit, dict) and "model_fingerprint" in lenskit:  # written by save_reference: check the model
        check_fingerprint(lenskit, model, path, remedy=JACOBIAN_REMEDY)
    matrices = {l + 1: checked_matrix(m, f"{path}: layer {l}", d).to(torch.float64 if m.dtype == torch.float64 else torch.float32)
                for l, m in J.items()}
    if checkpoint:
        matrices = {s: m / count for s, m in matrices.items()}
    estimator = {"n_prompts": count}
    if isinstance(lenskit, dict) and isinstance(lenskit.get("estimator"), dict):
        estimator = {**lenskit["estimator"], "n_prompts": count}
    imported = {"format": "jacobian-lens checkpoint" if checkpoint else "jacobian-lens", "file": path.as_posix(),
                "metadata": {k: v for k, v in metadata.items() if k != "lenskit"}}
    return cls(model, matrices, info={"estimator": estimator, "imported_from": imported})


PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def check_plain(value: object, where: str) -> None:
    """Tensors, None, bool, int, float and str, in dicts, lists and tuples; anything else (what weights_only still
    lets through: dtypes, devices, ...) is refused in one line naming where it sits."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise ValueError(f"{where} has a key of type {type(k).__name__}; expected tensors and plain values only")
            check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, PLAIN):
        raise ValueError(f"{where} holds a {type(value).__name__}; a Jacobian lens file holds tensors and plain values only")


# ------------------------------------------------------------------ any source
def load(cls: type[JacobianLens], source: str | os.PathLike, model: HookedTransformer, filename: str | None = None) -> JacobianLens:
    path = Path(source).expanduser()
    if path.is_file():
        if filename is not None:
            raise ValueError(f"{source} is a file; pass filename only with a folder or a hub repo id")
        return read_reference(cls, path, model)
    if path.is_dir():
        target = path / filename if filename is not None else path
        return load_folder(cls, target, model) if target.is_dir() else read_reference(cls, target, model)
    if filename is not None:
        target = resolve_hub_file(str(source), filename)
        return load_folder(cls, target.parent, model) if target.name == CONFIG_FILE else read_reference(cls, target, model)
    try:
        folder = resolve_model_folder(source)
    except FileNotFoundError:
        raise FileNotFoundError(f"no Jacobian lens at {source}: no such file or folder; pass a lens folder, a reference .pt, "
                                "or a hub repo id (with filename= for a .pt inside it)") from None
    except OSError as e:
        raise OSError(f"{source!r} is not a local lens folder or file, and not a hub repo in the local Hugging Face cache "
                      f"({str(e).splitlines()[0][:160]}); pass a local path, or filename= for a .pt inside the repo") from None
    return load_folder(cls, folder, model)

"""The tuned lens (Belrose et al. 2023): one affine translator per stream, trained to match the final output.

Translators are residual maps `h -> h + A_l h + b_l` with A_l and b_l zero at the start, so an
untrained lens is exactly the logit lens, and weight decay on (A_l, b_l) pulls toward the identity.

>>> tuned = TunedLens(model)                 # then lenses.training.train(tuned, stream) or `lenskit train-lens`
>>> tuned(cache.stream(2), 2)                # logits [batch, pos, d_vocab]
>>> tuned(cache.stream("resid_mid.2"), Stream(2, "resid_mid"))   # with TunedLens(model, resid_mid=True)
>>> tuned.save("my_lens");  TunedLens.load("my_lens", model)
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lenskit import HookedTransformer, Stream

from .base import Lens
from .io import CONFIG_FILE, read_config, write_atomic

FORMAT = "lenskit-tuned-lens"
FORMAT_VERSION = 1
WEIGHTS_FILE = "lens.safetensors"
# config.json keys that describe the lens itself; the rest (recipe, data, tokens_seen, ...) is `TunedLens.info`.
STRUCTURE_KEYS = ("format", "format_version", "model_fingerprint", "model_name", "n_layers", "d_model", "d_vocab",
                  "resid_mid", "weights")


def model_fingerprint(model: HookedTransformer) -> str:
    """sha256 of the final norm and unembedding, the part of the model a lens decodes through.

    Each parameter is hashed as its name, its shape, then its values as little-endian float32 in
    C order, so the digest depends on the numbers alone: not on the device, the storage dtype's
    quirks, strides, pickling or the Python version (tuned-lens' hash of a pickle broke on exactly that).
    """
    digest = hashlib.sha256()
    params = {f"ln_final.{n}": p for n, p in model.ln_final.named_parameters()}
    params.update({f"unembed.{n}": p for n, p in model.unembed.named_parameters()})
    for name in sorted(params):
        values = params[name].detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
        digest.update(f"{name}:{list(values.shape)}\n".encode())
        digest.update(np.ascontiguousarray(values, dtype="<f4").tobytes())
    return "sha256:" + digest.hexdigest()


class TunedLens(Lens):
    """`tuned(h, l)`: decode stream l (after l blocks) through its translator, then the model's final norm
    and unembedding. Stream l = n_layers is the model's own output and has no translator.

    With `resid_mid=True` it also holds a translator for each block's `resid_mid` (halfway through
    block l, after attention), used as `tuned(h, Stream(l, "resid_mid"))`. A `resid_post` stream is
    read as the `resid_pre` of the next block, the same place.
    """

    name = "tuned"

    def __init__(self, model: HookedTransformer, resid_mid: bool = False) -> None:
        super().__init__(model)
        d_model, n = model.cfg.d_model, model.cfg.n_layers
        param = model.unembed.weight
        # Translators train in float32 even on a bf16/fp16 model (half-precision Adam updates would round away).
        kwargs = dict(device=param.device, dtype=torch.float64 if param.dtype == torch.float64 else torch.float32)
        self.translators = nn.ModuleList(nn.Linear(d_model, d_model, **kwargs) for _ in range(n))
        self.mid_translators = nn.ModuleList(nn.Linear(d_model, d_model, **kwargs) for _ in range(n)) if resid_mid else None
        self.reset_parameters()
        self.fingerprint = model_fingerprint(model)
        # What the lens was trained on and how; filled in by lenses.training and written by save().
        self.info: dict[str, Any] = {}

    @property
    def has_mid(self) -> bool:
        return self.mid_translators is not None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Zero every A_l and b_l: the lens becomes the logit lens again."""
        for p in self.parameters():
            p.zero_()

    def trained_streams(self) -> list[Stream]:
        """Every stream that has a translator, in depth order: 0, (resid_mid.0,) 1, ..., n_layers - 1."""
        points = ("resid_pre", "resid_mid") if self.has_mid else ("resid_pre",)
        return [Stream(l, p) for l in range(self.n_layers) for p in points]

    def translator(self, s: int | str | Stream) -> nn.Linear | None:
        """The translator for stream s (None at the final stream, where the lens is the identity)."""
        s = self.stream(s).canonical()
        if s.point == "resid_mid":
            if self.mid_translators is None:
                raise ValueError("this lens has no resid_mid translators; build it with TunedLens(model, resid_mid=True)")
            return self.mid_translators[s.layer]
        if s.point != "resid_pre":
            raise ValueError(f"a tuned lens decodes resid_pre streams (and resid_mid if trained for them), not {s.point}; "
                             "use LogitLens for sublayer writes")
        return None if s.layer == self.n_layers else self.translators[s.layer]

    def transform_hidden(self, h: torch.Tensor, s: Stream) -> torch.Tensor:
        """[..., d_model] -> [..., d_model]: h + A_s h + b_s (the identity at the final stream)."""
        t = self.translator(s)
        return h if t is None else h + t(h if h.dtype == t.weight.dtype else h.to(t.weight.dtype))

    def extra_repr(self) -> str:
        return f"n_layers={self.n_layers}, d_model={self.model.cfg.d_model}, resid_mid={self.has_mid}"

    # ----------------------------------------------------------------- files
    def config(self) -> dict[str, Any]:
        cfg = self.model.cfg
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "model_fingerprint": self.fingerprint, "model_name": cfg.name,
            "n_layers": cfg.n_layers, "d_model": cfg.d_model, "d_vocab": cfg.d_vocab,
            "resid_mid": self.has_mid, "weights": WEIGHTS_FILE, **self.info,
        }

    def save(self, folder: str | os.PathLike) -> Path:
        """Write `config.json` and `lens.safetensors` into folder, each atomically (temp file, then rename)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        write_atomic(folder / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": FORMAT}))
        text = json.dumps(self.config(), indent=2) + "\n"
        write_atomic(folder / CONFIG_FILE, lambda tmp: tmp.write_text(text))
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike, model: HookedTransformer) -> "TunedLens":
        """Load a lens saved by `save` (or by the tuned-lens package: config.json + params.pt) onto `model`.

        Refused when the lens was trained for a model whose final norm and unembedding differ.
        """
        folder = Path(folder)
        config = read_config(folder)
        if config.get("format") != FORMAT:
            if (folder / "params.pt").exists():
                return import_tuned_lens_package(folder, model)
            raise ValueError(f"{folder / CONFIG_FILE} is not a lenskit tuned lens (format {config.get('format')!r}, "
                             f"expected {FORMAT!r}) and there is no tuned-lens params.pt beside it")
        check_shape(config, model, folder)
        here = model_fingerprint(model)
        if config["model_fingerprint"] != here:
            raise ValueError(
                f"the lens in {folder} was trained for the model with fingerprint {config['model_fingerprint']} "
                f"({config.get('model_name')!r}), but this model's fingerprint is {here} ({model.cfg.name!r}); "
                "load the model the lens was trained for, or train a new lens with `lenskit train-lens`"
            )
        lens = cls(model, resid_mid=bool(config.get("resid_mid", False)))
        state = load_file(str(folder / config.get("weights", WEIGHTS_FILE)))
        lens.load_state_dict(checked_state(lens, state, folder))
        lens.info = {k: v for k, v in config.items() if k not in STRUCTURE_KEYS}
        return lens


def check_shape(config: dict, model: HookedTransformer, folder: Path) -> None:
    for key, ours in (("n_layers", model.cfg.n_layers), ("d_model", model.cfg.d_model)):
        if config.get(key) != ours:
            raise ValueError(f"the lens in {folder} has {key}={config.get(key)} but the model has {key}={ours}; "
                             "load the model the lens was trained for")


def checked_state(lens: TunedLens, state: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """Every key the lens needs, with its shape, and nothing else; cast to the lens' dtype and device."""
    expected = lens.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"{source}: lens weights do not match: missing {missing[:4]}, unexpected {extra[:4]}")
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise ValueError(f"{source}: {k} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}")
    return {k: v.to(expected[k]) for k, v in state.items()}


def import_tuned_lens_package(folder: str | os.PathLike, model: HookedTransformer) -> TunedLens:
    """Convert a lens saved by the tuned-lens package (`config.json` + `params.pt`).

    params.pt is read with `torch.load(weights_only=True)`, which accepts plain tensors only, never
    arbitrary pickled objects. Its translators are `{i}.weight/bias` (newer versions) or
    `layer_translators.{i}.weight/bias`, the same residual form and layer numbering as ours.
    Their `unembed_hash` cannot be checked against our fingerprint (it hashed a pickle), so the shape is
    checked and the lens is stamped with this model's fingerprint; save it to get a lenskit folder.
    """
    folder = Path(folder)
    config = read_config(folder)
    shape = {"n_layers": config.get("num_hidden_layers"), "d_model": config.get("d_model")}
    check_shape(shape, model, folder)
    if config.get("lens_type", "linear_tuned_lens") != "linear_tuned_lens":
        raise ValueError(f"{folder}: lens_type {config['lens_type']!r} is not supported; expected 'linear_tuned_lens'")
    raw = torch.load(folder / "params.pt", map_location="cpu", weights_only=True)
    if not isinstance(raw, dict):
        raise ValueError(f"{folder / 'params.pt'} holds a {type(raw).__name__}, expected a state dict of tensors")
    state = {}
    for key, value in raw.items():
        key = key.removeprefix("layer_translators.")
        index, _, kind = key.partition(".")
        if not index.isdigit() or kind not in ("weight", "bias"):
            raise ValueError(f"{folder / 'params.pt'}: unexpected key {key!r}; expected '<layer>.weight' or '<layer>.bias'")
        state[f"translators.{index}.{kind}"] = value
    lens = TunedLens(model)
    if config.get("bias", True) is False:  # translators without bias: b_l stays zero
        for l in range(model.cfg.n_layers):
            state.setdefault(f"translators.{l}.bias", torch.zeros(model.cfg.d_model))
    lens.load_state_dict(checked_state(lens, state, folder / "params.pt"))
    lens.info = {"imported_from": {"format": "tuned-lens", "folder": folder.as_posix(),
                                   "base_model_name_or_path": config.get("base_model_name_or_path"),
                                   "unembed_hash": config.get("unembed_hash")}}
    return lens

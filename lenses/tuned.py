"""The tuned lens (Belrose et al. 2023): one affine translator per stream, trained to match the final output.

Translators are residual maps `h -> h + A_l h + b_l` with A_l and b_l zero at the start, so an
untrained lens is exactly the logit lens, and weight decay on (A_l, b_l) pulls toward the identity.
A bias-only lens (`TunedLens(model, bias_only=True)`, the paper's baseline) has `h -> h + b_l`: no A_l at all.

>>> tuned = TunedLens(model)                 # then lenses.training.train(tuned, stream) or `lenskit train-lens`
>>> tuned(cache.stream(2), 2).shape          # logits [batch, pos, d_vocab]
torch.Size([1, 13, 4096])
>>> mid = TunedLens(model, resid_mid=True)
>>> mid(cache.stream(Stream(2, "resid_mid")), Stream(2, "resid_mid")).shape
torch.Size([1, 13, 4096])
>>> folder = tuned.save("my_lens");  again = TunedLens.load(folder, model)
>>> sorted(p.name for p in Path("my_lens").iterdir())
['README.md', 'config.json', 'lens.safetensors']

A hub repo id loads from the local Hugging Face cache: `TunedLens.load("someone/gpt2-tuned-lens", model)`.

A lens folder is config.json + lens.safetensors + README.md (a model card), a ready Hugging Face model repo.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from lenskit import HookedTransformer, Stream
from lenskit.io.files import check_regular_file
from lenskit.io.hub import resolve_model_folder
from lenskit.io.torchfile import read_plain_torch_file

from .base import BasisLens
from .card import CARD_FILE, check_eval, model_card
from .io import CONFIG_FILE, read_config, write_atomic

FORMAT = "lenskit-tuned-lens"
FORMAT_VERSION = 1
WEIGHTS_FILE = "lens.safetensors"
# config.json keys that describe the lens itself; the rest (recipe, data, tokens_seen, ...) is `TunedLens.info`.
STRUCTURE_KEYS = ("format", "format_version", "model_fingerprint", "model_name", "n_layers", "d_model", "d_vocab",
                  "resid_mid", "bias_only", "weights", "model_dtype", "model_fingerprints_reduced")
# A model loaded in a lower precision has other final-norm and unembedding values, so another fingerprint.
# A lens saved from a float32 model also records the fingerprints of those values rounded to these dtypes.
REDUCED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def model_fingerprint(model: HookedTransformer, dtype: torch.dtype | None = None) -> str:
    """The model's family, then the sha256 of its final norm and unembedding, the part of the model a lens
    decodes through: `"llama:sha256:..."`. The family tells apart models whose readouts happen to agree
    but whose streams do not mean the same (a Llama and a Qwen 3 of one shape), and names both in errors.

    Each parameter is hashed as its name, its shape, then its values as little-endian float32 in
    C order, so the digest depends on the numbers alone: not on the device, the storage dtype's
    quirks, strides, pickling or the Python version (tuned-lens' hash of a pickle broke on exactly that).
    With `dtype`, the values are first rounded to that dtype (what the model would hold if loaded in it).
    Centred writing weights (`model.processing`) move every stream along the all-ones direction without touching
    the readout, so they are hashed too and a lens fitted on the raw weights is refused there. (The other processing
    options leave the streams as they were or rewrite the readout itself.) A raw model's digest is as it always was.
    """
    digest = hashlib.sha256()
    if "center_writing_weights" in getattr(model, "processing", ()):
        digest.update(b"processing:center_writing_weights\n")
    params = {f"ln_final.{n}": p for n, p in model.ln_final.named_parameters()}
    params.update({f"unembed.{n}": p for n, p in model.unembed.named_parameters()})
    for name in sorted(params):
        values = params[name].detach().to("cpu")
        values = (values.to(dtype) if dtype is not None else values).to(torch.float32).contiguous().numpy()
        digest.update(f"{name}:{list(values.shape)}\n".encode())
        digest.update(np.ascontiguousarray(values, dtype="<f4").tobytes())
    return f"{model.cfg.family}:sha256:{digest.hexdigest()}"


class BiasTranslator(nn.Module):
    """The translator of a bias-only lens: `h -> b`, which the lens adds to h (h + b). There is no A to hold
    at zero: nothing of it is stored, decayed, updated or multiplied."""

    def __init__(self, d_model: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(d_model, device=device, dtype=dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.bias.expand_as(h)  # [..., d_model], a view

    def extra_repr(self) -> str:
        return f"d_model={self.bias.shape[0]}"


class TunedLens(BasisLens):
    """`tuned(h, l)`: decode stream l (after l blocks) through its translator, then the model's final norm
    and unembedding. Stream l = n_layers is the model's own output and has no translator.

    With `resid_mid=True` it also holds a translator for each block's `resid_mid` (halfway through
    block l, after attention), used as `tuned(h, Stream(l, "resid_mid"))`. A `resid_post` stream is
    read as the `resid_pre` of the next block, the same place. With `bias_only=True` every translator is
    `h -> h + b_l` (a `BiasTranslator`): the tuned-lens paper's bias-only lens.
    """

    name = "tuned"

    def __init__(self, model: HookedTransformer, resid_mid: bool = False, bias_only: bool = False) -> None:
        super().__init__(model)
        d_model, n = model.cfg.d_model, model.cfg.n_layers
        param = model.unembed.weight
        # Translators train in float32 even on a bf16/fp16 model (half-precision Adam updates would round away).
        kwargs = dict(device=param.device, dtype=torch.float64 if param.dtype == torch.float64 else torch.float32)
        self.bias_only = bool(bias_only)

        def make() -> nn.Module:  # the kind of translator is chosen once, here
            return BiasTranslator(d_model, **kwargs) if bias_only else nn.Linear(d_model, d_model, **kwargs)

        self.translators = nn.ModuleList(make() for _ in range(n))
        self.mid_translators = nn.ModuleList(make() for _ in range(n)) if resid_mid else None
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

    def translator(self, s: int | str | Stream) -> nn.Linear | BiasTranslator | None:
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
        """[..., d_model] -> [..., d_model]: h + A_s h + b_s, or h + b_s if bias-only (the identity at the final stream)."""
        t = self.translator(s)
        if t is None:
            return h
        h = h.to(t.bias.device)  # under a device map, a stream read on its block's device is read where the lens lives
        if t.bias.dtype == h.dtype:
            return h + t(h)
        # A float32 lens on a lower-precision model: translate in float32, read out in the model's dtype.
        wide = h.to(t.bias.dtype)
        return (wide + t(wide)).to(h.dtype)

    def reads_as_model(self, s: Stream) -> bool:
        return self.translator(s) is None

    def extra_repr(self) -> str:
        return f"n_layers={self.n_layers}, d_model={self.model.cfg.d_model}, resid_mid={self.has_mid}, bias_only={self.bias_only}"

    # ----------------------------------------------------------------- files
    def config(self) -> dict[str, Any]:
        cfg = self.model.cfg
        model_dtype = self.model.unembed.weight.dtype
        reduced = {}
        if model_dtype == torch.float32:
            reduced = {name: model_fingerprint(self.model, dtype) for name, dtype in REDUCED_DTYPES.items()}
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "model_fingerprint": self.fingerprint, "model_name": cfg.name,
            "model_dtype": str(model_dtype).removeprefix("torch."), "model_fingerprints_reduced": reduced,
            "n_layers": cfg.n_layers, "d_model": cfg.d_model, "d_vocab": cfg.d_vocab,
            "resid_mid": self.has_mid, "bias_only": self.bias_only, "weights": WEIGHTS_FILE, **self.info,
        }

    def save(self, folder: str | os.PathLike) -> Path:
        """Write `lens.safetensors`, `config.json` and a `README.md` model card into folder, each atomically,
        holding the folder's lock (lenses/training/lock.py): one writer per lens folder, threads of this process
        taking turns, and a folder another process trains into refused."""
        from .training.lock import folder_lock

        folder = Path(folder)
        with folder_lock(folder, join=True):
            self._write(folder)
        return folder

    def _write(self, folder: Path) -> None:
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        write_atomic(folder / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": FORMAT}))
        config = self.config()
        text = json.dumps(config, indent=2) + "\n"
        write_atomic(folder / CONFIG_FILE, lambda tmp: tmp.write_text(text))
        card = model_card(config)
        write_atomic(folder / CARD_FILE, lambda tmp: tmp.write_text(card, encoding="utf-8"))

    @classmethod
    def load(cls, folder: str | os.PathLike, model: HookedTransformer) -> "TunedLens":
        """Load a lens saved by `save` (or by the tuned-lens package: config.json + params.pt) onto `model`.

        `folder` is a local folder, or a hub repo id found in the local Hugging Face cache (downloaded only
        when the network is allowed, as for models). Refused when the lens was trained for a model whose
        final norm and unembedding differ. A float32 lens keeps float32 translators on a lower-precision model.
        """
        folder = resolve_lens_folder(folder)
        config = read_config(folder)
        if config.get("format") != FORMAT:
            if (folder / "params.pt").exists():
                return import_tuned_lens_package(folder, model)
            raise ValueError(f"{folder / CONFIG_FILE} is not a lenskit tuned lens (format {config.get('format')!r}, "
                             f"expected {FORMAT!r}) and there is no tuned-lens params.pt beside it")
        check_config(config, folder / CONFIG_FILE)
        check_shape(config, model, folder)
        check_fingerprint(config, model, folder)
        state = read_weights(folder / config["weights"])
        lens = cls(model, resid_mid=config["resid_mid"], bias_only=config.get("bias_only", False))  # older: full
        saved = {v.dtype for v in state.values()}
        if len(saved) == 1 and next(iter(saved)) == torch.float32:
            lens.to(torch.float32)  # the translators keep the precision they were trained in
        lens.load_state_dict(checked_state(lens, state, folder / config["weights"]))
        lens.info = {k: v for k, v in config.items() if k not in STRUCTURE_KEYS}
        return lens


def resolve_lens_folder(spec: str | os.PathLike) -> Path:
    """A local lens folder as is; a hub repo id through the local Hugging Face cache (lenskit's model resolution)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    try:
        return resolve_model_folder(spec)
    except FileNotFoundError:
        raise FileNotFoundError(f"no {CONFIG_FILE} in {spec}: no such folder; expected a tuned-lens folder written by "
                                "TunedLens.save or `lenskit train-lens`, or a hub repo id") from None
    except NotADirectoryError:
        raise NotADirectoryError(f"{spec} is a file; pass the lens folder that holds {CONFIG_FILE} and {WEIGHTS_FILE}") from None
    except OSError:
        raise OSError(f"{spec!r} is not a local lens folder, and not a hub repo in the local Hugging Face cache; on a "
                      f"machine with network run `hf download {spec}`, or pass the lens folder") from None


# A fingerprint: "<family>:sha256:<hex>"; lenses saved before families carry "sha256:<hex>" alone.
FINGERPRINT = re.compile(r"(?:([A-Za-z0-9_.-]+):)?sha256:([0-9a-f]{64})")


def same_fingerprint(saved: object, here: str) -> bool:
    """`saved` names the model `here` names: equal, or a family-less (older) fingerprint whose digest matches."""
    a, b = FINGERPRINT.fullmatch(saved) if isinstance(saved, str) else None, FINGERPRINT.fullmatch(here)
    if a is None or b is None:
        return False
    return a.group(2) == b.group(2) and (a.group(1) is None or a.group(1) == b.group(1))


# What each config.json key must hold: (test, description).
def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


CONFIG_TYPES = {
    "format_version": (_is_int, "an integer"),
    "model_fingerprint": (lambda v: isinstance(v, str) and FINGERPRINT.fullmatch(v) is not None,
                          "a string '<family>:sha256:<hex>' (or 'sha256:<hex>' from older lenskit)"),
    "n_layers": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "d_model": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "resid_mid": (lambda v: isinstance(v, bool), "true or false"),
    "weights": (lambda v: isinstance(v, str) and v.endswith(".safetensors") and Path(v).name == v,
                "the name of a .safetensors file in the folder"),
}
# Keys added after lens folders were first written: checked where present; absent, the older meaning holds.
OPTIONAL_CONFIG_TYPES = {
    "bias_only": (lambda v: isinstance(v, bool), "true or false (absent: a full affine lens)"),
}


def check_config(config: dict, path: Path) -> None:
    """Every structural key present with the right JSON type; ValueError names the file and the field."""
    if config.get("format_version") is not None and _is_int(config["format_version"]) and config["format_version"] > FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {config['format_version']} is newer than this lenskit reads "
                         f"({FORMAT_VERSION}); upgrade lenskit")
    for key, (ok, want) in CONFIG_TYPES.items():
        if key not in config:
            raise ValueError(f"{path} has no {key!r}; a lenskit lens config needs it (save or train the lens again)")
        if not ok(config[key]):
            raise ValueError(f"{path}: {key!r} must be {want}, got {json.dumps(config[key])}")
    for key, (ok, want) in OPTIONAL_CONFIG_TYPES.items():
        if key in config and not ok(config[key]):
            raise ValueError(f"{path}: {key!r} must be {want}, got {json.dumps(config[key])}")
    check_eval(config, path)  # else it loads, and the next save fails on it


def check_shape(config: dict, model: HookedTransformer, folder: Path) -> None:
    for key, ours in (("n_layers", model.cfg.n_layers), ("d_model", model.cfg.d_model)):
        value = config.get(key)
        if not _is_int(value):
            raise ValueError(f"the lens config in {folder}: {key!r} must be an integer, got {json.dumps(value)}")
        if value != ours:
            raise ValueError(f"the lens in {folder} has {key}={value} but the model has {key}={ours}; "
                             "load the model the lens was trained for")


def check_fingerprint(config: dict, model: HookedTransformer, folder: Path,
                      remedy: str = "train a new lens with `lenskit train-lens`") -> None:
    """The model's final norm and unembedding must be the ones the lens was trained through, up to the rounding
    of loading the same model in another precision. `remedy` ends the refusal: how to get a lens for this model."""
    saved, here = config["model_fingerprint"], model_fingerprint(model)
    if same_fingerprint(saved, here):
        return
    ours = str(model.unembed.weight.dtype).removeprefix("torch.")
    theirs = config.get("model_dtype")
    reduced = config.get("model_fingerprints_reduced") or {}
    if isinstance(reduced, dict) and same_fingerprint(reduced.get(ours), here):
        return  # a float32-trained lens on the same model loaded in bfloat16 / float16
    if theirs in REDUCED_DTYPES and same_fingerprint(saved, model_fingerprint(model, REDUCED_DTYPES[theirs])):
        return  # a lens trained on the reduced-precision model, used on the float32 one
    dtypes = f" (the lens was trained on a {theirs} model, this one is {ours})" if theirs and theirs != ours else ""
    raise ValueError(
        f"the lens in {folder} was trained for another model{dtypes}: lens fingerprint {saved}, this model's "
        f"{here} ({config.get('model_name')!r} vs {model.cfg.name!r}); load the model the lens was trained for, "
        f"or {remedy}"
    )


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a lens weights file; a missing, non-regular (FIFO) or unreadable file is one line naming it."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path} does not exist; the lens folder is incomplete (its config.json names it)")
    check_regular_file(path, "a lens weights file (safetensors)")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {detail}; "
                         "save or train the lens again") from None


def checked_state(lens: TunedLens, state: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """Every key the lens needs, with its shape, and nothing else; cast to the lens' dtype and device."""
    expected = lens.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"{source}: lens weights do not match: missing {missing[:4]}, unexpected {extra[:4]}")
    for k, v in state.items():
        if v.shape != expected[k].shape:
            raise ValueError(f"{source}: {k} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}")
        if not v.dtype.is_floating_point:
            raise ValueError(f"{source}: {k} has dtype {v.dtype}; lens weights must be floating point")
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"{source}: {k} holds NaN or inf values; the lens is corrupt or its training diverged")
    return {k: v.to(expected[k]) for k, v in state.items()}


def import_tuned_lens_package(folder: str | os.PathLike, model: HookedTransformer) -> TunedLens:
    """Convert a lens saved by the tuned-lens package (`config.json` + `params.pt`).

    params.pt is read with `lenskit.io.torchfile.read_plain_torch_file`: uncompressed entries whose sizes match
    their tensors (no zip bomb), then `torch.load(weights_only=True)`, which accepts plain tensors only, never
    arbitrary pickled objects. Its translators are `{i}.weight/bias` (newer versions) or
    `layer_translators.{i}.weight/bias`, the same residual form and layer numbering as ours.
    Their `unembed_hash` cannot be checked against our fingerprint (it hashed a pickle), so the shape is
    checked and the lens is stamped with this model's fingerprint; save it to get a lenskit folder.
    """
    folder = Path(folder)
    config = read_config(folder)
    if config.get("lens_type", "linear_tuned_lens") != "linear_tuned_lens":
        raise ValueError(f"{folder}: lens_type {config['lens_type']!r} is not supported; expected 'linear_tuned_lens'")
    raw = read_plain_torch_file(folder / "params.pt")  # uncompressed entries of the declared sizes, then weights_only
    shape = {"n_layers": config.get("num_hidden_layers"), "d_model": config.get("d_model")}
    check_shape(shape, model, folder)
    if not isinstance(raw, dict):
        raise ValueError(f"{folder / 'params.pt'} holds a {type(raw).__name__}, expected a state dict of tensors")
    state = {}
    for key, value in raw.items():
        key = key.removeprefix("layer_translators.")
        index, _, kind = key.partition(".")
        if not index.isdigit() or kind not in ("weight", "bias"):
            raise ValueError(f"{folder / 'params.pt'}: unexpected key {key!r}; expected '<layer>.weight' or '<layer>.bias'")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{folder / 'params.pt'}: {key!r} holds a {type(value).__name__}, expected a tensor")
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

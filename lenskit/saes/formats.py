"""SAE files as people publish them, each read into one `SAEConfig` plus weights in `lenskit.saes.sae`'s
orientation. Nothing here unpickles: safetensors, `numpy.load(allow_pickle=False)`, and dictionary_learning's
`ae.pt` through lenskit's checked reader (lenskit.io.torchfile).

| format | files | read as |
|---|---|---|
| SAELens (<= 5 and 6) | cfg.json + sae_weights.safetensors | standard (relu), topk, jumprelu, gated; transcoders |
| Gemma Scope | params.npz (or params.safetensors) | jumprelu, pre = x @ W_enc + b_enc |
| EleutherAI sparsify | cfg.json + sae.safetensors | topk on relu(encoder(x - b_dec)); transcoders, skip |
| circuit-tracer | one layer's .safetensors (W_enc [d_sae, d_in]) | jumprelu / topk / relu transcoder, W_skip |
| dictionary_learning | ae.pt (+ config.json) | standard, topk, batch-topk (its inference threshold) |
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..io.files import check_regular_file, read_json_object
from ..io.hub import resolve_hub_file
from ..io.torchfile import TorchFileError, read_plain_torch_file
from ..observe.stream import POINTS

# SAEs that ship with lenskit: short name -> folder beside this module.
EMBEDDED_SAES = {"stdlib-gpt2-sae-L3": "stdlib_gpt2_sae_L3"}

SAELENS_ARCH = {"standard": "relu", "topk": "topk", "jumprelu": "jumprelu", "gated": "gated",
                "transcoder": "relu", "skip_transcoder": "relu", "jumprelu_transcoder": "jumprelu",
                "jumprelu_skip_transcoder": "jumprelu", "topk_transcoder": "topk"}
# SAELens normalisations that leave inference alone: "expected_average_only_in" is folded into the saved weights.
INERT_NORMALISATION = (None, "none", "expected_average_only_in")

if TYPE_CHECKING:
    from .sae import SAE

ARCHITECTURES = ("relu", "topk", "jumprelu", "gated")


@dataclass(frozen=True)
class SAEConfig:
    """What a loaded SAE is: sizes, activation, where it reads and writes, and where it came from."""

    d_in: int
    d_sae: int
    architecture: str  # one of ARCHITECTURES
    hook_name: str | None = None
    d_out: int | None = None  # None: d_in (an SAE); a transcoder's output width
    hook_name_out: str | None = None  # None: hook_name (an SAE)
    k: int | None = None  # topk only
    apply_b_dec_to_input: bool = False
    format: str = "lenskit"  # saelens | gemma_scope | sparsify | circuit_tracer | dictionary_learning
    source: str = ""
    model_name: str | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"SAE architecture {self.architecture!r} is not one lenskit computes; expected one of {ARCHITECTURES}")
        if self.architecture == "topk" and not (isinstance(self.k, int) and 0 < self.k <= self.d_sae):
            raise ValueError(f"a topk SAE needs an integer k in 1..d_sae={self.d_sae}, got k={self.k!r} ({self.source})")

    @property
    def out_width(self) -> int:
        return self.d_in if self.d_out is None else self.d_out

    @property
    def is_transcoder(self) -> bool:
        return self.hook_name_out is not None and self.hook_name_out != self.hook_name


# What each reader gives `SAE.load`: the SAE's config and its tensors by SAELens's names (W_enc, W_dec, b_dec ...).
Loaded = tuple[SAEConfig, dict[str, torch.Tensor]]


class SAEFileError(ValueError):
    """An SAE folder or file that is not one of the formats lenskit reads, or is damaged."""


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


def read_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    check_regular_file(path, "an SAE weights file (safetensors)")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError, KeyError) as e:
        raise SAEFileError(f"{path} is not a readable safetensors file (truncated or corrupt?): {_first_line(e)}; "
                           "download it again") from None


def read_npz(path: Path) -> dict[str, torch.Tensor]:
    check_regular_file(path, "an SAE weights file (.npz)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: torch.from_numpy(np.array(npz[k])) for k in npz.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise SAEFileError(f"{path} is not a readable .npz of arrays (truncated, corrupt, or holding pickled objects, "
                           f"which lenskit refuses): {_first_line(e)}") from None


def _pick_hook(hook: str | tuple[str, str] | None, found: str | None) -> tuple[str | None, str | None]:
    """(input hook, output hook or None): `hook=` overrides what the files say."""
    if hook is None:
        return found, None
    if isinstance(hook, (tuple, list)):
        if len(hook) != 2 or not all(isinstance(h, str) for h in hook):
            raise TypeError(f"hook must be a hook name or (input_hook, output_hook), got {hook!r}")
        return hook[0], hook[1]
    if not isinstance(hook, str):
        raise TypeError(f"hook must be a hook name or (input_hook, output_hook), got {type(hook).__name__}")
    return hook, None


# ------------------------------------------------------------------ SAELens
def _saelens(folder: Path, hook: Any) -> Loaded:
    cfg = read_json_object(folder / "cfg.json", "an SAELens cfg.json")
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}

    def field(name: str, default: Any = None) -> Any:  # SAELens 6 moved the hook and model into "metadata"
        return cfg.get(name, meta.get(name, default))

    arch_name = cfg.get("architecture", "standard")
    if arch_name == "standard" and str(cfg.get("activation_fn_str", cfg.get("activation_fn", "relu"))) == "topk":
        arch_name = "topk"  # SAELens <= 5 spelled TopK as a standard SAE with a topk activation
    if arch_name not in SAELENS_ARCH:
        raise SAEFileError(f"{folder}/cfg.json: SAELens architecture {arch_name!r} is not supported; lenskit reads "
                           f"{sorted(SAELENS_ARCH)}")
    norm = cfg.get("normalize_activations")
    norm = ("expected_average_only_in" if norm else "none") if isinstance(norm, bool) else norm  # SAELens <= 5's flag
    if norm not in INERT_NORMALISATION:
        raise SAEFileError(f"{folder}/cfg.json: normalize_activations={norm!r} rescales inputs at run time, which "
                           f"lenskit does not implement (it reads {INERT_NORMALISATION[1:]}); fold it into the weights first")
    for flag in ("rescale_acts_by_decoder_norm", "use_sparse_activations"):
        if cfg.get(flag):
            raise SAEFileError(f"{folder}/cfg.json: {flag}=true is not implemented by lenskit; refusing rather than "
                               "computing a different function")
    reshape = cfg.get("reshape_activations", "none")
    if reshape not in ("none", "hook_z", None):
        raise SAEFileError(f"{folder}/cfg.json: reshape_activations={reshape!r} is not supported (expected 'none' or 'hook_z')")
    k = field("k", (cfg.get("activation_fn_kwargs") or {}).get("k") if isinstance(cfg.get("activation_fn_kwargs"), dict) else None)
    hook_in, hook_out = _pick_hook(hook, field("hook_name", cfg.get("hook_point")))  # hook_point: SAELens <= 2
    hook_out = hook_out or field("hook_name_out")
    weights = read_safetensors_file(folder / "sae_weights.safetensors")
    if "log_threshold" in weights and "threshold" not in weights:
        weights["threshold"] = weights.pop("log_threshold").exp()  # SAELens's training form
    sc = SAEConfig(d_in=_int(cfg, "d_in", folder), d_sae=_int(cfg, "d_sae", folder), architecture=SAELENS_ARCH[arch_name],
                   hook_name=hook_in, hook_name_out=hook_out, d_out=cfg.get("d_out"), k=k,
                   apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", False)), format="saelens",
                   source=str(folder), model_name=field("model_name"))
    return (sc, weights)


def _int(cfg: dict, key: str, where: Path) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise SAEFileError(f"{where}: config field {key!r} must be a positive integer, found {v!r}")
    return v


def write_saelens(sae: "SAE", folder: str | os.PathLike, extra: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    c = sae.cfg
    arch = {"relu": "standard", "topk": "topk", "jumprelu": "jumprelu", "gated": "gated"}[c.architecture]
    if c.is_transcoder or sae.W_skip is not None:
        raise ValueError("only SAEs (one hook, no skip) are written in SAELens's layout here")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"architecture": arch, "d_in": c.d_in, "d_sae": c.d_sae, "dtype": str(sae.dtype).removeprefix("torch."),
           "device": "cpu", "apply_b_dec_to_input": c.apply_b_dec_to_input, "normalize_activations": "none",
           "reshape_activations": "none",
           # SAELens reads "metadata" only from files that give a version of its 6.x layout, the one written here.
           "metadata": {"sae_lens_version": "6.0.0", "hook_name": c.hook_name, "model_name": c.model_name, **extra}}
    if c.k is not None:
        cfg["k"] = c.k
    save_file({n: p.detach().contiguous().cpu() for n, p in sae.named_parameters()}, str(folder / "sae_weights.safetensors"))
    (folder / "cfg.json").write_text(json.dumps(cfg, indent=2) + "\n")


# --------------------------------------------------------------- Gemma Scope
_GEMMA_SITES: dict[str, str | tuple[str, str]] = {"res": f"blocks.{{}}.{POINTS['resid_post']}", "mlp": f"blocks.{{}}.{POINTS['mlp_out']}",
                "att": "blocks.{}.attn.hook_z", "transcoders": ("blocks.{}.ln2.hook_normalized", f"blocks.{{}}.{POINTS['mlp_out']}")}


def gemma_scope_hook(repo: str | None, sub: str) -> str | tuple[str, str] | None:
    """The hook Gemma Scope's naming implies: the repository's last dash-word (`gemma-scope-2b-pt-res`) says the
    site, its `layer_<L>` folder the block; None when either is missing."""
    layer = re.match(r"layer_(\d+)(/|$)", sub)
    site = re.search(r"-(res|mlp|att|transcoders)$", repo or "")
    if not (layer and site):
        return None
    fmt, n = _GEMMA_SITES[site.group(1)], int(layer.group(1))
    return (fmt[0].format(n), fmt[1].format(n)) if isinstance(fmt, tuple) else fmt.format(n)


def _gemma_scope(path: Path, hook: Any, implied: Any) -> Loaded:
    weights = read_npz(path) if path.suffix == ".npz" else read_safetensors_file(path)
    missing = {"W_enc", "W_dec", "b_enc", "b_dec", "threshold"} - set(weights)
    if missing:
        raise SAEFileError(f"{path}: a Gemma Scope file holds W_enc, W_dec, b_enc, b_dec and threshold; missing {sorted(missing)}")
    hook = hook if hook is not None else implied
    hook_in, hook_out = _pick_hook(hook, None)
    d_in, d_sae = weights["W_enc"].shape
    return (SAEConfig(d_in=d_in, d_sae=d_sae, architecture="jumprelu", hook_name=hook_in, hook_name_out=hook_out,
                         d_out=weights["W_dec"].shape[-1] if hook_out else None, format="gemma_scope",
                         source=str(path)), weights)


# ------------------------------------------------------------------ sparsify
def sparsify_hook(name: str) -> str | None:
    """sparsify's folder names are module paths: `layers.3` (a block's output) or `layers.3.mlp` (its MLP's)."""
    m = re.fullmatch(r"(?:model\.)?layers\.(\d+)(\.mlp)?", name)
    if not m:
        return None
    return f"blocks.{m.group(1)}.{POINTS['mlp_out'] if m.group(2) else POINTS['resid_post']}"


def _sparsify(folder: Path, hook: Any) -> Loaded:
    cfg = read_json_object(folder / "cfg.json", "a sparsify cfg.json")
    if cfg.get("activation", "topk") != "topk":
        raise SAEFileError(f"{folder}/cfg.json: sparsify activation {cfg.get('activation')!r} is not supported (topk only)")
    for flag in ("signed",):
        if cfg.get(flag):
            raise SAEFileError(f"{folder}/cfg.json: sparsify's {flag}=true is not implemented by lenskit")
    raw = read_safetensors_file(folder / "sae.safetensors")
    if not {"encoder.weight", "encoder.bias", "W_dec", "b_dec"} <= set(raw):
        raise SAEFileError(f"{folder}/sae.safetensors: a sparsify file holds encoder.weight, encoder.bias, W_dec and b_dec; "
                           f"found {sorted(raw)}")
    d_in = _int(cfg, "d_in", folder)
    d_sae = cfg.get("num_latents") or d_in * cfg.get("expansion_factor", 0)
    if raw["encoder.weight"].shape != (d_sae, d_in):
        raise SAEFileError(f"{folder}: encoder.weight has shape {tuple(raw['encoder.weight'].shape)}, but cfg.json says "
                           f"[{d_sae}, {d_in}] (num_latents or d_in x expansion_factor)")
    transcode = bool(cfg.get("transcode", False))
    if transcode and not isinstance(hook, (tuple, list)):
        raise SAEFileError(f"{folder} is a sparsify transcoder; pass hook=(input_hook, output_hook), e.g. "
                           f"('blocks.3.ln2.hook_normalized', 'blocks.3.{POINTS['mlp_out']}')")
    hook_in, hook_out = _pick_hook(hook, sparsify_hook(folder.name))
    weights = {"W_enc": raw["encoder.weight"].T, "b_enc": raw["encoder.bias"], "W_dec": raw["W_dec"], "b_dec": raw["b_dec"]}
    if "W_skip" in raw:
        weights["W_skip"] = raw["W_skip"]
    return (SAEConfig(d_in=d_in, d_sae=d_sae, architecture="topk", k=cfg.get("k"), hook_name=hook_in,
                         hook_name_out=hook_out, apply_b_dec_to_input=not transcode, format="sparsify",
                         source=str(folder)), weights)


# -------------------------------------------------------------- circuit-tracer
def _circuit_tracer(path: Path, raw: dict[str, torch.Tensor], hook: Any) -> Loaded:
    if not isinstance(hook, (tuple, list)):
        raise SAEFileError(f"{path} is a circuit-tracer transcoder, whose file names no hooks; pass "
                           f"hook=(input_hook, output_hook), e.g. ('blocks.3.ln2.hook_normalized', 'blocks.3.{POINTS['mlp_out']}')")
    d_sae, d_in = raw["W_enc"].shape
    weights = {"W_enc": raw["W_enc"].T, "b_enc": raw["b_enc"], "W_dec": raw["W_dec"], "b_dec": raw["b_dec"]}
    arch, k = "relu", None
    if "activation_function.threshold" in raw:
        arch, weights["threshold"] = "jumprelu", raw["activation_function.threshold"].reshape(-1).expand(d_sae)
    elif "k" in raw:
        arch, k = "topk", int(raw["k"])
    if "W_skip" in raw:
        weights["W_skip"] = raw["W_skip"]
    hook_in, hook_out = _pick_hook(hook, None)
    return (SAEConfig(d_in=d_in, d_sae=d_sae, architecture=arch, k=k, hook_name=hook_in, hook_name_out=hook_out,
                         d_out=raw["W_dec"].shape[-1], format="circuit_tracer", source=str(path)), weights)


# --------------------------------------------------------- dictionary_learning
def _dictionary_learning(path: Path, hook: Any) -> Loaded:
    try:
        raw = read_plain_torch_file(path, "a dictionary_learning ae.pt (a state dict of tensors)")
    except TorchFileError as e:
        raise SAEFileError(str(e)) from None
    if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise SAEFileError(f"{path} is not a state dict of tensors")
    found = None
    config = path.parent / "config.json"
    if config.is_file():
        trainer = read_json_object(config, "a dictionary_learning config.json").get("trainer", {})
        layer, submodule = trainer.get("layer"), trainer.get("submodule_name") or ""
        if isinstance(layer, int) and "resid" in submodule:
            found = f"blocks.{layer}.{POINTS['resid_post']}"
    hook_in, hook_out = _pick_hook(hook, found)
    if {"encoder.weight", "encoder.bias", "decoder.weight", "bias"} <= set(raw):  # AutoEncoder: relu(enc(x - bias))
        weights = {"W_enc": raw["encoder.weight"].T, "b_enc": raw["encoder.bias"], "W_dec": raw["decoder.weight"].T,
                   "b_dec": raw["bias"]}
        arch, k = "relu", None
    elif {"encoder.weight", "encoder.bias", "decoder.weight", "b_dec", "k"} <= set(raw):  # TopK / BatchTopK
        weights = {"W_enc": raw["encoder.weight"].T, "b_enc": raw["encoder.bias"], "W_dec": raw["decoder.weight"].T,
                   "b_dec": raw["b_dec"]}
        arch, k = "topk", int(raw["k"])
        if "threshold" in raw and float(raw["threshold"].reshape(-1)[0]) >= 0:
            # BatchTopK's inference rule: relu(pre) kept where it passes the learned threshold, no top-k.
            arch, k = "jumprelu", None
            weights["threshold"] = raw["threshold"].reshape(-1).expand(weights["b_enc"].shape[0]).float()
    else:
        raise SAEFileError(f"{path}: not a dictionary_learning AutoEncoder, TopK or BatchTopK state dict (keys {sorted(raw)[:8]})")
    d_in, d_sae = weights["W_enc"].shape
    return (SAEConfig(d_in=d_in, d_sae=d_sae, architecture=arch, k=k, hook_name=hook_in, hook_name_out=hook_out,
                         apply_b_dec_to_input=True, format="dictionary_learning", source=str(path)), weights)


# ------------------------------------------------------------------ dispatch
def _read_local(path: Path, hook: Any, implied: Any = None) -> Loaded:
    if path.is_file():
        if path.suffix == ".npz":
            return _gemma_scope(path, hook, implied)
        if path.suffix == ".pt":
            return _dictionary_learning(path, hook)
        if path.suffix == ".safetensors":
            raw = read_safetensors_file(path)
            circuit = {"activation_function.threshold", "W_skip", "k"} & set(raw)
            if "W_enc" in raw and "W_dec" in raw and (circuit or raw["W_enc"].shape == raw["W_dec"].shape != raw["W_enc"].T.shape):
                return _circuit_tracer(path, raw, hook)
            return _gemma_scope(path, hook, implied)
        raise SAEFileError(f"{path}: expected a folder, a .npz (Gemma Scope), a .safetensors (Gemma Scope or "
                           "circuit-tracer) or an ae.pt (dictionary_learning)")
    if (path / "cfg.json").is_file() and (path / "sae_weights.safetensors").is_file():
        return _saelens(path, hook)
    if (path / "cfg.json").is_file() and (path / "sae.safetensors").is_file():
        return _sparsify(path, hook)
    for name in ("params.npz", "params.safetensors"):
        if (path / name).is_file():
            return _gemma_scope(path / name, hook, implied)
    if (path / "ae.pt").is_file():
        return _dictionary_learning(path / "ae.pt", hook)
    raise SAEFileError(f"{path} holds no SAE lenskit reads: expected cfg.json + sae_weights.safetensors (SAELens), "
                       "cfg.json + sae.safetensors (sparsify), params.npz (Gemma Scope) or ae.pt (dictionary_learning)")


_HUB_FILES = ("cfg.json", "sae_weights.safetensors", "sae.safetensors", "params.npz", "params.safetensors", "ae.pt", "config.json")


def _from_hub(text: str, hook: Any) -> Loaded:
    """`org/repo/sub/folder` through the local hub cache (lenskit.io.hub): the folder's files, then as local."""
    parts = text.split("/")
    repo, sub = "/".join(parts[:2]), "/".join(parts[2:])
    got: dict[str, Path] = {}
    last: Exception | None = None
    for name in _HUB_FILES:
        try:
            got[name] = resolve_hub_file(repo, f"{sub}/{name}" if sub else name)
        except OSError as e:
            last = e
    if not got:
        raise OSError(f"no SAE files of {text!r} in the local Hugging Face cache: {_first_line(last) if last else ''}")
    folder = next(iter(got.values())).parent
    return _read_local(folder, hook, gemma_scope_hook(repo, sub))


def embedded_sae_folder(name: str) -> Path:
    """The folder of an SAE that ships with lenskit, by its short name (`stdlib-gpt2-sae-L3`)."""
    folder = Path(__file__).parent / EMBEDDED_SAES[name]
    if not (folder / "cfg.json").is_file():
        raise FileNotFoundError(f"the embedded SAE {name} is missing at {folder}; reinstall lenskit")
    return folder


def read_sae(path_or_repo: str | os.PathLike, hook: Any = None) -> Loaded:
    text = str(path_or_repo)
    if text in EMBEDDED_SAES:
        return _read_local(embedded_sae_folder(text), hook)
    path = Path(path_or_repo).expanduser()
    if path.exists():
        sae = _read_local(path, hook, gemma_scope_hook(*_repo_and_sub(path)))
    elif re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+(/[\w.-]+)*", text) and not text.startswith((".", "~", "/")):
        sae = _from_hub(text, hook)
    else:
        raise FileNotFoundError(f"no SAE at {text}: pass a folder or file, a hub path (org/repo/folder), or one of "
                                f"{sorted(EMBEDDED_SAES)}")
    return sae


def _repo_and_sub(path: Path) -> tuple[str | None, str]:
    """For a local copy of a Gemma Scope repo: the folder named like the repo, and the path below it."""
    parts = path.resolve().parts
    for i in range(len(parts) - 1, -1, -1):
        if re.search(r"-(res|mlp|att|transcoders)$", parts[i]):
            return parts[i], "/".join(parts[i + 1:])
    return None, ""

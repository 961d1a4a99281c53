"""Lens specs: the one place where a string on the command line (or in a notebook) becomes a lens.

    logit                         the logit lens
    FOLDER or HUB_ID              a lens folder: tuned or Jacobian, as its config.json says (or tuned-lens' params.pt)
    FILE.pt                       a Jacobian lens in the reference implementation's format
    tuned:FOLDER_OR_ID            a tuned lens, said explicitly
    jacobian:SOURCE[:FILENAME]    a Jacobian lens: folder, reference .pt, or hub repo id plus the file's name in it
    patchscope[:TARGET_PROMPT]    a patchscope; "\\n" in the prompt is a newline (default: the identity prompt)

>>> tuned.save("runs/tuned_lens")
PosixPath('runs/tuned_lens')
>>> lenses = load_lenses(["logit", "runs/tuned_lens", "patchscope"], model)
>>> {name: type(lens).__name__ for name, lens in lenses.items()}
{'logit': 'LogitLens', 'tuned': 'TunedLens', 'patchscope': 'Patchscope'}
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # the CLI imports SPEC_HELP for its --help, which must not import torch
    from lenskit import HookedTransformer

    from .base import Lens

KINDS = ("logit", "tuned", "jacobian", "patchscope")
SPEC_HELP = "logit | FOLDER | tuned:FOLDER | jacobian:FOLDER_OR_FILE_OR_ID[:FILENAME] | patchscope[:TARGET_PROMPT]"


def split_spec(spec: str) -> tuple[str, str]:
    """(kind, argument): 'logit' -> ('logit', ''); 'jacobian:x' -> ('jacobian', 'x'); a bare path -> ('', path).

    A spec that names an existing file or folder is a path, even if it contains a colon."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a lens spec must be a non-empty string ({SPEC_HELP}), got {spec!r}")
    if Path(spec).expanduser().exists():
        return "", spec
    kind, sep, arg = spec.partition(":")
    if kind in KINDS:
        if kind == "logit" and sep:
            raise ValueError(f"lens spec {spec!r}: the logit lens takes no argument; pass 'logit'")
        if kind in ("tuned", "jacobian") and not arg:
            raise ValueError(f"lens spec {spec!r}: say which lens, e.g. {kind}:FOLDER")
        return kind, arg
    return "", spec


def load_lens(spec: str, model: "HookedTransformer") -> "Lens":
    """The lens a spec names, on `model` (see the module docstring); errors are one line naming the spec."""
    kind, arg = split_spec(spec)
    if kind == "logit":
        from .logit import LogitLens

        return LogitLens(model)
    if kind == "patchscope":
        from .patchscope import DEFAULT_TARGET_PROMPT, Patchscope

        return Patchscope(model, arg.replace("\\n", "\n") if arg else DEFAULT_TARGET_PROMPT)
    if kind == "tuned":
        from .tuned import TunedLens

        return TunedLens.load(arg, model)
    if kind == "jacobian":
        from .jacobian import JacobianLens

        source, filename = _source_and_file(arg)
        return JacobianLens.load(source, model, filename=filename)
    return _load_path(spec, model)


def _source_and_file(arg: str) -> tuple[str, str | None]:
    """'repo/id:path/in/repo.pt' -> ('repo/id', 'path/in/repo.pt'); a local path (even with a colon) stays whole."""
    if Path(arg).expanduser().exists():
        return arg, None
    source, sep, filename = arg.partition(":")
    return (source, filename) if sep and filename else (arg, None)


def _load_path(spec: str, model: "HookedTransformer") -> "Lens":
    """A folder or hub id: its config.json's format decides the lens kind; a .pt file is a reference Jacobian lens."""
    from .io import read_config
    from .jacobian import FORMAT as JACOBIAN_FORMAT
    from .jacobian import JacobianLens
    from .tuned import TunedLens, resolve_lens_folder

    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix == ".pt":
            return JacobianLens.load(path, model)
        raise ValueError(f"--lens {spec}: a file; expected a lens folder, a Jacobian lens .pt, or {SPEC_HELP}")
    try:
        folder = resolve_lens_folder(spec)
    except FileNotFoundError:
        raise FileNotFoundError(f"--lens {spec!r}: no such folder or file, and not a lens kind; pass {SPEC_HELP}") from None
    if read_config(folder).get("format") == JACOBIAN_FORMAT:
        return JacobianLens.load(folder, model)
    return TunedLens.load(folder, model)


def load_lenses(specs: Sequence[str], model: "HookedTransformer") -> "dict[str, Lens]":
    """{label: lens} for several specs, in order. A label is the lens's kind ('logit', 'tuned', 'jacobian',
    'patchscope'); where two specs give lenses of one kind, each is labelled with its spec instead."""
    loaded = [(spec, load_lens(spec, model)) for spec in specs]
    kinds = [getattr(lens, "name", type(lens).__name__.lower()) for _, lens in loaded]
    labels = [kind if kinds.count(kind) == 1 else spec for (spec, _), kind in zip(loaded, kinds)]
    if len(set(labels)) != len(labels):
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        raise ValueError(f"--lens {repeated[0]} is given twice; pass each lens once")
    return dict(zip(labels, (lens for _, lens in loaded)))

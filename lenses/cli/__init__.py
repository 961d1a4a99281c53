"""The `lenskit` command line. Each subcommand lives in its own module with `add_parser` and `run`."""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys

# subcommand name -> module under lenses.cli
COMMANDS = {
    "lens": "lens",
    "info": "info",
    "train-lens": "train_lens",
    "eval-lens": "eval_lens",
    "ablate": "ablate",
    "cache": "cache",
    "train-sae": "train_sae",
    "features": "features",
    "fit-jacobian": "fit_jacobian",
}
# The one-line help `lenskit --help` lists, so that listing the commands imports none of their modules
# (they import torch, which takes seconds). Each module's add_parser uses the same line.
SUMMARY = {
    "lens": "show what each layer predicts for a prompt, through one lens or several",
    "info": "parameter and FLOP accounting of a model",
    "train-lens": "train a tuned lens (resumes from --out)",
    "eval-lens": "evaluate lenses side by side, per layer",
    "ablate": "ablate blocks, sublayers or heads and compare predictions with the clean run",
    "cache": "export activations to sharded safetensors (resumes from --out)",
    "train-sae": "train a TopK SAE on a `lenskit cache` export (resumes from --out)",
    "features": "read an SAE feature's direction through lenses at every later stream",
    "fit-jacobian": "fit a Jacobian lens on text or tokens (resumes from --out)",
}


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose "invalid choice" says which choices are closest (subcommands included)."""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if action.choices is not None and value not in action.choices:
            # difflib here rather than lenskit.suggest.did_you_mean: importing lenskit imports torch (seconds).
            close = difflib.get_close_matches(str(value), list(map(str, action.choices)), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{hint} (choose from {', '.join(map(repr, action.choices))})")
        super()._check_value(action, value)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `lenskit` parser: the full parser of `command` (its module imported now), a stub for the others.

    With `command=None` every command is a stub, which is all that `lenskit --help` needs.
    """
    parser = Parser(prog="lenskit", description="Read GPT-2's residual stream layer by layer.")
    parser.add_argument("--version", action="version", version=f"lenskit {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        if name == command:
            importlib.import_module(f"lenses.cli.{module}").add_parser(sub, name)
        else:
            sub.add_parser(name, help=SUMMARY[name], add_help=False)
    return parser


def version() -> str:
    """The installed distribution's version (`lenskit-interp`); `lenskit.__version__` when run from a bare checkout."""
    from importlib import metadata

    try:
        return metadata.version("lenskit-interp")
    except metadata.PackageNotFoundError:
        from lenskit import __version__  # imports torch: only when no installed metadata says it

        return __version__


def _command(argv: list[str]) -> str | None:
    """The subcommand named in `argv`: its first word that is not an option (the top level takes none)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """Run one command. Ctrl-C at any moment, start-up and model load included, is one line and exit 130; SIGTERM,
    SIGHUP and SIGUSR1 likewise, with 128 + their number (lenses.stopping)."""
    from ..stopping import exit_code, stopped_by, stops_interrupt

    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command(argv)
    try:
        with stops_interrupt():
            args = build_parser(command).parse_args(argv)
            return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print(f"lenskit {command}: {stopped_by()}interrupted" if command else "lenskit: interrupted", file=sys.stderr)
        return exit_code()
    except BrokenPipeError:
        # The reader went away (`lenskit lens ... | head`); that is not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"lenskit {command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

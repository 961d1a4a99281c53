"""The `lenskit` command line. Each subcommand lives in its own module with `add_parser` and `run`."""

from __future__ import annotations

import argparse
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
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lenskit", description="Read GPT-2's residual stream layer by layer.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        importlib.import_module(f"lenses.cli.{module}").add_parser(sub, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:
        # The reader went away (`lenskit lens ... | head`); that is not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"lenskit {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

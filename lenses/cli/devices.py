"""`--device` and `--dtype`: the same two options on every command that runs a model.

A command adds them with `add_device_options(parser)` and, first thing in its `run`, turns them into
`from_pretrained` keywords with `model_options(args)`, which refuses a bad spelling in one line before any work.
The names are read by `lenskit.devices`, as the Python API reads them.

    model = lenskit.HookedTransformer.from_pretrained(args.model, **model_options(args))
"""

from __future__ import annotations

import argparse
import sys

DEVICE_HELP = ("cpu, cuda, cuda:1 or mps (default: cuda when torch sees a GPU, else cpu; a CUDA build of torch "
               "prints which it chose)")
DTYPE_HELP = ("auto (the checkpoint's own dtype on a GPU, float32 on the CPU; the default), float32 or fp32, "
              "bfloat16 or bf16, float16 or fp16")


def add_device_options(p: argparse.ArgumentParser) -> None:
    """--device and --dtype, in a group of their own."""
    g = p.add_argument_group("device and precision")
    g.add_argument("--device", default=None, metavar="DEVICE", help=DEVICE_HELP)
    g.add_argument("--dtype", default="auto", metavar="DTYPE", help=DTYPE_HELP)


def model_options(args: argparse.Namespace, device=None, announce: bool = True) -> dict:
    """{"device": torch.device, "dtype": str} for `from_pretrained`, checked now (one ValueError line each).

    `device`, when given, is the one torchrun assigned this rank (`lenses.training.init_distributed`); it
    overrides --device's default. With --device left out, on a torch built for GPUs, one line on stderr says
    which device was chosen and why (`announce=False` keeps it quiet, e.g. on every rank but the first).
    """
    import torch

    from lenskit.devices import default_device, parse_device, parse_dtype

    parse_dtype(args.dtype, auto=torch.float32, name="--dtype")  # a bad spelling fails now; "auto" resolves at load
    if device is not None:
        return {"device": device, "dtype": args.dtype}
    chosen = parse_device(args.device or default_device(), name="--device")
    gpu_build = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
    if args.device is None and announce and (gpu_build or chosen.type != "cpu"):
        why = (f"torch sees {torch.cuda.device_count()} CUDA device(s); --device cpu for the CPU" if chosen.type == "cuda"
               else f"this torch ({torch.__version__}) sees no CUDA device; check nvidia-smi and CUDA_VISIBLE_DEVICES")
        print(f"lenskit {getattr(args, 'command', None) or 'run'}: device {chosen} ({why})", file=sys.stderr)
    return {"device": chosen, "dtype": args.dtype}

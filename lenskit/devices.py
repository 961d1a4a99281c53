"""Where a model runs and in what precision: the one place a device or dtype name becomes a torch object.

The Python API (`HookedTransformer.from_pretrained(..., dtype=, device=)`) and every `--device` / `--dtype`
option of the command line read names through here, so both take the same spellings:

- dtype: "float32" / "fp32", "bfloat16" / "bf16", "float16" / "fp16" (a "torch." prefix is fine), a floating
  torch dtype, None (float32, the reference numerics), or "auto": the checkpoint's own dtype (config.json's
  `dtype`, or `torch_dtype` as transformers 4 wrote it) on an accelerator, float32 on the CPU, where
  half-precision matmuls are emulated on most processors (lenskit.pieces.linear);
- device: what torch.device takes ("cpu", "cuda", "cuda:1", "mps"), checked against this torch and machine.

>>> parse_dtype("bf16")
torch.bfloat16
>>> auto_dtype({"dtype": "bfloat16"}, accelerated=True)
torch.bfloat16
"""

from __future__ import annotations

import difflib
from typing import Mapping

import torch

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = {"float32": FP32, "fp32": FP32, "bfloat16": BF16, "bf16": BF16, "float16": FP16, "fp16": FP16}
AUTO = "auto"
DTYPE_CHOICES = "auto, float32 (fp32), bfloat16 (bf16), float16 (fp16)"


def _named(name: str, value: object) -> str:
    """How an argument reads in an error: `dtype='x'` for a keyword, `--dtype x` for a command-line option."""
    return f"{name} {value}" if name.startswith("-") else f"{name}={value!r}"


def is_auto(dtype: object) -> bool:
    return isinstance(dtype, str) and dtype.strip().lower() == AUTO


def parse_dtype(dtype: torch.dtype | str | None, auto: torch.dtype | None = None, name: str = "dtype") -> torch.dtype:
    """A floating torch dtype from a dtype, one of its names (`DTYPES`, case and a "torch." prefix aside) or None
    (float32). "auto" is `auto`, the dtype the caller resolved it to (see `auto_dtype`); without one it is refused.
    `name` is how the argument is spelled in errors ("dtype", or "--dtype" on the command line)."""
    if dtype is None:
        return FP32
    if isinstance(dtype, torch.dtype):
        if dtype.is_floating_point:
            return dtype
        raise ValueError(f"{_named(name, dtype)} is not a floating dtype; pass one of {DTYPE_CHOICES}")
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key]
        if key == AUTO:
            if auto is None:
                raise ValueError(f"{_named(name, dtype)} needs a checkpoint to read its dtype from; pass float32, "
                                 "bfloat16 or float16 here")
            return auto
        close = difflib.get_close_matches(key, [*DTYPES, AUTO], n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"{_named(name, dtype)} is not a dtype lenskit takes; {hint}expected one of {DTYPE_CHOICES}")
    raise ValueError(f"{_named(name, dtype)} is not a dtype; pass one of {DTYPE_CHOICES} or a floating torch dtype")


def checkpoint_dtype(config: Mapping) -> torch.dtype | None:
    """The dtype a Hugging Face config.json says its weights are in (`dtype`, else `torch_dtype`, else the same in
    its `text_config`), if it is one lenskit runs in; None if it names none."""
    for source in (config, config.get("text_config")):
        if not isinstance(source, Mapping):
            continue
        for key in ("dtype", "torch_dtype"):
            value = source.get(key)
            if isinstance(value, str) and value.lower().removeprefix("torch.") in DTYPES:
                return DTYPES[value.lower().removeprefix("torch.")]
    return None


def auto_dtype(config: Mapping, accelerated: bool) -> torch.dtype:
    """What dtype="auto" means for this checkpoint: on an accelerator (`accelerated`) the checkpoint's own dtype,
    or float32 when its config names none; on the CPU float32."""
    return (checkpoint_dtype(config) or FP32) if accelerated else FP32


def default_device() -> str:
    """"cuda" when torch sees a CUDA (or ROCm) device, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_device(device: str | torch.device | None, name: str = "device") -> torch.device:
    """A torch device that this torch can use (None: the CPU). One line says why not, before anything is loaded:
    a name torch does not know, "meta" (which holds shapes and no values), CUDA on a torch built without it or with no GPU visible, an index past the last GPU."""
    if device is None:
        return torch.device("cpu")
    cpu = _named(name, "cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{_named(name, device)} is not a device torch knows ({detail}); pass 'cpu', 'cuda', "
                         "'cuda:1' or 'mps'") from None
    if parsed.type == "meta":
        raise ValueError(f"{_named(name, device)}: the meta device holds shapes and no values, so weights or "
                         "activations there would be lost; pass 'cpu' or an accelerator")
    if parsed.type == "cuda":
        if torch.version.cuda is None and not torch.cuda.is_available():
            raise ValueError(f"{_named(name, device)}, but this torch ({torch.__version__}) is built without CUDA; pass "
                             f"{cpu}, or install a CUDA build of torch (https://pytorch.org/get-started/locally/)")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{_named(name, device)}, but no CUDA device is visible (torch {torch.__version__}, CUDA "
                             f"{torch.version.cuda}); check nvidia-smi and CUDA_VISIBLE_DEVICES, or pass {cpu}")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"{_named(name, device)}, but only {count} CUDA device(s) are visible (cuda:0 to "
                             f"cuda:{count - 1})")
    elif parsed.type != "cpu":
        try:
            torch.empty(0, device=parsed)
        except (RuntimeError, AssertionError, ValueError) as e:
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{_named(name, device)} cannot be used by this torch ({torch.__version__}): {detail}; "
                             f"pass {cpu}") from None
    return parsed

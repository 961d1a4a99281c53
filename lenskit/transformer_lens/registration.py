"""`lenskit.transformer_lens.install()`: the namespace under the name `transformer_lens`, for tools written for
TransformerLens that import it themselves (SAELens, circuit-tracer).

>>> import lenskit.transformer_lens
>>> lenskit.transformer_lens.install()     # before `import sae_lens`
>>> import sae_lens                         # its `import transformer_lens` gets lenskit's namespace
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

NAME = "transformer_lens"


def install() -> None:
    """Register `lenskit.transformer_lens` and each of its submodules as `transformer_lens` and
    `transformer_lens.<submodule>` in `sys.modules`. Call it again and nothing changes.

    Refuses when a real TransformerLens was imported first: code already holding its classes would mix them with
    lenskit's. Start a fresh interpreter and call install() before anything imports transformer_lens.
    """
    package = sys.modules[__package__]
    present = sys.modules.get(NAME)
    if present is not None and present is not package:
        raise ImportError(f"a real transformer_lens ({getattr(present, '__file__', present)}) was imported before "
                          "lenskit.transformer_lens.install(); call install() first, in a fresh interpreter")
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{__package__}."):
        importlib.import_module(info.name)
    ours = [name for name in sys.modules if name == __package__ or name.startswith(f"{__package__}.")]
    for name in ours:
        sys.modules[NAME + name[len(__package__):]] = sys.modules[name]

"""lenses: analysis that reads lenskit's residual stream (logit lens, tuned lens, trajectories, plots).

>>> from lenses import LogitLens, Trajectory
>>> traj = Trajectory.from_prompt(model, LogitLens(model), "import os\\nos.path.")
>>> from lenses import plots; plots.save_figure(plots.logit_lens_heatmap(traj), "lens.png")
"""

from importlib import import_module
from typing import Any

from . import metrics
from .base import Lens
from .logit import POINTS, LogitLens
from .trajectory import Trajectory

# Imported on first use: `plots` pulls in plotly, and `TunedLens` lives in its own, heavier module.
_LAZY = {"TunedLens": ("lenses.tuned", "TunedLens"), "plots": ("lenses.plots", None)}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lenses' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = import_module(module_name)
    return module if attr is None else getattr(module, attr)


__all__ = ["Lens", "LogitLens", "POINTS", "Trajectory", "TunedLens", "metrics", "plots"]

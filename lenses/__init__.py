"""lenses: analysis that reads lenskit's residual stream (logit, tuned and Jacobian lenses, patchscopes, trajectories, plots).

>>> from lenses import LogitLens, Trajectory
>>> traj = Trajectory.from_prompt(LogitLens(model), "import os\\nos.path.")
>>> from lenses import plots; plots.save_figure(plots.logit_lens_heatmap(traj), "lens.png")
PosixPath('lens.png')
"""

from importlib import import_module
from typing import Any

# Every name is imported on first use, so that `lenskit --help` (lenses.cli) starts without torch,
# pandas or plotly.
_LAZY = {
    "BasisLens": ("lenses.base", "BasisLens"),
    "JacobianLens": ("lenses.jacobian", "JacobianLens"),
    "Lens": ("lenses.base", "Lens"),
    "LogitLens": ("lenses.logit", "LogitLens"),
    "POINTS": ("lenses.logit", "POINTS"),
    "Patchscope": ("lenses.patchscope", "Patchscope"),
    "Trajectory": ("lenses.trajectory", "Trajectory"),
    "TunedLens": ("lenses.tuned", "TunedLens"),
    "causal": ("lenses.causal", None),
    "metrics": ("lenses.metrics", None),
    "plots": ("lenses.plots", None),
    "transfer": ("lenses.transfer", None),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lenses' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = import_module(module_name)
    return module if attr is None else getattr(module, attr)


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = ["BasisLens", "JacobianLens", "Lens", "LogitLens", "POINTS", "Patchscope", "Trajectory", "TunedLens", "causal",
           "metrics", "plots", "transfer"]

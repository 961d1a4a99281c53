"""Figures for papers and notebooks. The only place that imports plotly; every function returns a `go.Figure`
and none calls `.show()`. Statistics are computed elsewhere (`Trajectory`, `metrics`, `anatomy`); this
package only draws.

Modules: `style` (fonts, colours, token labels), `export` (`save_figure` to .html/.png/.svg/.pdf),
`lens` (logit-lens heatmap, per-layer curves), `anatomy`, `interventions`, `diagnostics` (layer transfer, causal fidelity),
`features` (the feature lens).
"""

from .anatomy import attribution_bars, growth_curves, head_attribution_heatmap, resid_norm_curves, share_bars
from .diagnostics import fidelity_curves, fidelity_scatter, transfer_heatmap
from .export import (
                     EXPORT_TIMEOUT_S,
                     STATIC_FORMATS,
                     check_static_export,
                     export_session,
                     figure_title,
                     save_figure,
                     save_figures,
                     set_pdf_title,
                     stop_export_browser,
)
from .features import feature_lens_heatmap
from .interventions import difference_heatmap, grouped_bars, patching_heatmap
from .lens import HEATMAP_CELL, HEATMAP_COLORS, KL_FLOOR, layer_curves, lens_stack, logit_lens_heatmap, select_window
from .style import COLORS, FONT, MONO, PAPER, PRINT_DPI, SIZES, display_token, token_labels

__all__ = [
    "COLORS",
    "EXPORT_TIMEOUT_S",
    "FONT",
    "HEATMAP_CELL",
    "HEATMAP_COLORS",
    "KL_FLOOR",
    "MONO",
    "PAPER",
    "PRINT_DPI",
    "SIZES",
    "STATIC_FORMATS",
    "attribution_bars",
    "check_static_export",
    "difference_heatmap",
    "display_token",
    "fidelity_curves",
    "fidelity_scatter",
    "export_session",
    "feature_lens_heatmap",
    "figure_title",
    "grouped_bars",
    "growth_curves",
    "head_attribution_heatmap",
    "layer_curves",
    "lens_stack",
    "logit_lens_heatmap",
    "patching_heatmap",
    "resid_norm_curves",
    "save_figure",
    "save_figures",
    "stop_export_browser",
    "select_window",
    "set_pdf_title",
    "share_bars",
    "token_labels",
    "transfer_heatmap",
]

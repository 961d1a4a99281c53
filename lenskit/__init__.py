"""lenskit: a hooked transformer whose residual stream you can read, edit and measure."""

import warnings
from pathlib import Path

# huggingface_hub (imported with transformers) imports tqdm.auto, which warns "IProgress not found" in a Jupyter
# kernel without ipywidgets. lenskit's own progress bars are plain tqdm and never need the widget.
warnings.filterwarnings("ignore", message="IProgress not found")

from . import accounting, families  # noqa: F401 - families registers the model families into lenskit.config
from .config import PRESETS, ModelConfig
from .intervene import interventions, patching
from .io import data
from .io.loading import EMBEDDED_MODELS as _EMBEDDED
from .io.loading import CheckpointError, embedded_model_folder
from .kv_cache import KVCache
from .model import HookedTransformer
from .observe.cache import ActivationCache
from .observe.hooks import HookPoint
from .observe.names import get_act_name
from .observe.slices import Slice
from .observe.stream import Stream

DEFAULT_MODEL: str = str(Path(__file__).parent / "default_model")
"""Filesystem path of the small GPT-2 that ships with lenskit (trained on the Python standard library);
`from_pretrained("stdlib-gpt2")` loads the same folder."""
EMBEDDED_MODELS: dict[str, str] = {name: str(embedded_model_folder(name)) for name in _EMBEDDED}
"""Short name -> folder of each model that ships with lenskit: `stdlib-gpt2` (the default) and `stdlib-llama`,
its Llama-architecture sibling trained on the same tokens. The short names work wherever a model is taken."""

__all__ = ["ActivationCache", "CheckpointError", "DEFAULT_MODEL", "EMBEDDED_MODELS", "HookPoint", "HookedTransformer", "KVCache", "ModelConfig", "PRESETS",
           "Slice", "Stream", "accounting", "data", "get_act_name", "interventions", "patching"]
__version__ = "0.1.0"

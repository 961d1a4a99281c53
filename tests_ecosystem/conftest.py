"""The tools written for TransformerLens, run on lenskit (scripts/ecosystem_env.sh builds their environment).

`lenskit.transformer_lens.install()` must run before SAELens or circuit-tracer is imported, so it runs here, at
collection, where neither has been imported yet. Where they are not installed (the main environment), the test
modules skip themselves and nothing is registered.
"""

import importlib.util
import sys

if (importlib.util.find_spec("sae_lens") or importlib.util.find_spec("circuit_tracer")) \
        and "transformer_lens" not in sys.modules:
    import lenskit.transformer_lens

    lenskit.transformer_lens.install()
    # circuit-tracer 0.5 imports HF_HUB_ENABLE_HF_TRANSFER from huggingface_hub.constants, which huggingface_hub 1.x
    # removed; transformers 5 (lenskit's) needs huggingface_hub >= 2.4, so no version has both. This defines that one
    # constant, False (hf_transfer off: nothing here downloads), before circuit-tracer is imported. Test-side only.
    import huggingface_hub.constants

    if not hasattr(huggingface_hub.constants, "HF_HUB_ENABLE_HF_TRANSFER"):
        huggingface_hub.constants.HF_HUB_ENABLE_HF_TRANSFER = False

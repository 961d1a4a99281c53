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

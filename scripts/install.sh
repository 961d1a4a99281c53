#!/usr/bin/env bash
# Installs lenskit and everything it needs on a fresh Debian machine, with no downloads beyond the
# package registries. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# torch first: the CPU wheel of this exact version is on local disk; a bare `torch` pulls a CUDA build.
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi

# Static figure export (PNG/SVG/PDF) uses kaleido 1.x, which drives a Chrome: Debian's chromium works offline.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

"$PY" -m pip install --quiet -e ".[dev]"

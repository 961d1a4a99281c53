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

# Static figure export (PNG/SVG/PDF) uses kaleido 1.x, which drives a headless Chrome: Debian's chromium
# works offline. kaleido's choreographer finds `chromium` on PATH (or the browser BROWSER_PATH names) and
# runs it headless with --no-sandbox, which also works as root. The figures ask for Liberation Sans and
# DejaVu Sans Mono; without them Chrome falls back to whatever fonts exist and labels change width.
need=()
if [ -z "${BROWSER_PATH:-}" ] && ! command -v chromium >/dev/null 2>&1; then need+=(chromium); fi
if ! command -v fc-list >/dev/null 2>&1 || ! fc-list | grep -q "DejaVu Sans Mono"; then need+=(fonts-dejavu-core); fi
if ! command -v fc-list >/dev/null 2>&1 || ! fc-list | grep -q "Liberation Sans"; then need+=(fonts-liberation); fi
if [ "${#need[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "install.sh: PNG/SVG/PDF export needs ${need[*]}; install them (or set BROWSER_PATH to a Chrome)." >&2
    fi
fi

# The docs extra builds the site (mkdocs); the bench extra has the peers (TransformerLens, tuned-lens, nnterp) that
# tests compare against. The constraints file pins every version to the ones the suite passed with (docs/reliability.md).
"$PY" -m pip install --quiet -c constraints.txt -e ".[dev,bench,docs]"

# Check that a static export really works here (a few seconds: it starts the browser once).
"$PY" -c "from lenses.plots import check_static_export; check_static_export()" \
    || echo "install.sh: static figure export does not work here; .html export still does" >&2

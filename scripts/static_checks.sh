#!/usr/bin/env bash
# Static checks (CI runs them before the tests; rules and the reasons for them in pyproject.toml and CONTRIBUTING.md):
# ruff for lint and import order over all the Python, mypy over the two packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check lenskit lenses tests experiments benchmarks scripts
# mypy's targets, options and per-module settings are in pyproject.toml ([tool.mypy]).
"$PY" -m mypy

#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite, end-to-end tests included, on 2 pytest-xdist workers.
# --dist loadscope keeps a module's tests (and its module-scoped fixtures) in one worker; --no-loadscope-reorder
# keeps the slow-modules-first order of tests/xdist_order.py. Extra arguments are forwarded and win (e.g. `-n 0`
# for one process, `-m "not slow"` for the fast loop).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadscope --no-loadscope-reorder "$@"

#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite, end-to-end tests included, on 2 pytest-xdist workers.
# --dist loadscope keeps a module's tests (and its module-scoped fixtures) in one worker; --no-loadscope-reorder
# keeps the slow-modules-first order of tests/xdist_order.py. Extra arguments are forwarded and win (e.g. `-n 0`
# for one process, `-m "not slow"` for the fast loop).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Where the environment sets PYTHONDONTWRITEBYTECODE (this project's machines do), each of the ~150 processes a
# run starts (xdist workers, services, engine and TP ranks, child pytests) would compile the modules it imports
# from source, and pytest would rewrite every test module's asserts again in each worker on every run. Compile
# the tree once here (compileall writes bytecode even so: ~1 s) and let pytest keep its rewritten modules.
.venv/bin/python -m compileall -q -j 0 bench benchmarks decode_worker engine examples gateway kvtransfer pdserve \
    prefill_worker rpc scripts tests training >/dev/null
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadscope --no-loadscope-reorder "$@"

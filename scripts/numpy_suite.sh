#!/bin/bash
# NumPy's own test suite with torchshm's allocator on in every process
# (issue 38), against the same suite without it:
#
#   scripts/numpy_suite.sh [MIN_BYTES] [PYTHON]     (defaults: 1, .venv/bin/python)
#
# Every interpreter the suite starts runs a sitecustomize that imports
# torchshm (both runs: importing torch alone fails 6 of NumPy 2.4's tests,
# its cpu-feature and ufunc-pickling ones) and, in the second run, calls
# set_allocator(True, min_bytes=MIN_BYTES), so every allocation of at least
# MIN_BYTES is born in shared memory. Prints pytest's summary line and the
# wall time of each run, and whether the same tests failed in both (exit 1
# if not). Not in CI: two runs of a few minutes each (at MIN_BYTES 1 the
# second took 1.05x the first's time, NumPy 2.4, 2-core reference machine).
set -euo pipefail
cd "$(dirname "$0")/.."
MIN_BYTES=${1:-1}
PY=${2:-.venv/bin/python}
[[ "$PY" == */* ]] && PY=$(realpath -s "$PY")  # the suite runs from a scratch folder
MODULES=$("$PY" -c 'import numpy as np
core = "numpy._core" if int(np.__version__.split(".")[0]) >= 2 else "numpy.core"
print(core, "numpy.lib numpy.ma numpy.linalg numpy.fft numpy.random numpy.polynomial")')
site=$(mktemp -d)
cat >"$site/sitecustomize.py" <<PYEOF
import os
if "TORCHSHM_SUITE_MIN_BYTES" in os.environ:
    import torchshm
    min_bytes = int(os.environ["TORCHSHM_SUITE_MIN_BYTES"])
    if min_bytes > 0:
        torchshm.set_allocator(True, min_bytes=min_bytes)
PYEOF
out=$(mktemp -d)
trap 'rm -rf "$site" "$out"' EXIT
suite() {  # suite NAME: prints the summary and the time; keeps what failed
    local start=$SECONDS
    # Failures and errors are what is compared: they must not stop the script.
    (cd "$site" && "$PY" -m pytest --pyargs $MODULES -m "not slow" -q -rfE \
        -p no:cacheprovider -p no:xdist -p no:randomly >"$out/$1.log" 2>&1) || true
    tail -1 "$out/$1.log"
    grep -E '^(FAILED|ERROR) ' "$out/$1.log" | sed 's/ - .*//' | sort >"$out/$1.failed" || true
    echo "  ($((SECONDS - start)) s)"
}
echo "== torchshm imported, allocator off"
TORCHSHM_SUITE_MIN_BYTES=0 PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" suite off
echo "== allocator on in every process, min_bytes $MIN_BYTES"
TORCHSHM_SUITE_MIN_BYTES=$MIN_BYTES PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" suite on
if diff "$out/off.failed" "$out/on.failed" >/dev/null; then
    echo "== the same tests failed in both runs ($(wc -l <"$out/on.failed"))"
else
    echo "== failures differ (< off, > on):"
    diff "$out/off.failed" "$out/on.failed" || true
    exit 1
fi

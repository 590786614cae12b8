#!/bin/bash
# PyTorch's own test/test_multiprocessing.py and test/test_dataloader.py, run
# twice on one lane: once plain ("baseline") and once with `import torchshm`
# in every Python process at interpreter start-up, through a sitecustomize.py
# put on PYTHONPATH ("default": its tensor path on, as a user gets it). It
# reports, per file and run, the counts of passed, failed,
# skipped, xfailed, xpassed and errors, the wall time, and the tests whose
# outcome differs from the baseline. Results: TORCH_SUITES_OUT/summary.txt, and
# per run RUN/FILE.jsonl (each test's phases), RUN/FILE.log (pytest -rA
# output), RUN/FILE.meta (wall time, pytest's rc, processes of the run still
# alive when pytest ended and 30 s later; those are then ended).
#
#   scripts/torch_suites.sh TESTS_DIR [RUN...]
#
# RUN is any of: baseline, default (torchshm imported everywhere with its own
# defaults: what a user's `import torchshm` gives, tensors included), switch
# (the same with TORCHSHM_TENSORS=1 set), import (torchshm imported everywhere
# but TORCHSHM_TENSORS=0: the array path alone), check (only checks that the
# import reaches spawned, forkserver and subprocess children), summary (only
# the summary of what TORCH_SUITES_OUT holds). Default: "baseline default".
# A later call with other runs and the same TORCH_SUITES_OUT adds to the results and compares against the baseline
# recorded there, so the baseline need not be run again.
#
# TESTS_DIR holds the two test files of the torch that the lane's Python
# imports (they import torch.testing._internal from the installed torch, so
# they must match its version):
# - Debian's torch (1.13.1 on bookworm, 2.6.0 on trixie): from the `pytorch`
#   source package, e.g. `apt-get source --download-only pytorch` with a
#   deb-src line for that release, or the .orig.tar.xz from deb.debian.org's
#   pool/main/p/pytorch/; the files are test/test_multiprocessing.py and
#   test/test_dataloader.py (Debian's patches do not touch them).
# - A pip wheel: the same two files from github.com/pytorch/pytorch at the
#   wheel's tag (vX.Y.Z), e.g. `git show vX.Y.Z:test/test_dataloader.py`.
# torch.testing._internal.common_utils imports `expecttest`, which neither
# the wheel nor Debian's python3-torch pulls in: install it, or put it in a
# folder named by TORCH_SUITES_PYDEPS (`pip install --target DIR expecttest`).
#
# Environment:
#   PYTHON                 the lane's interpreter (default: python3 on PATH)
#   TORCH_SUITES_OUT       results folder (default ./torch_suites_results)
#   TORCH_SUITES_FILES     test files (default: the two above)
#   TORCH_SUITES_TIMEOUT   per-test timeout in s (pytest-timeout; default 300)
#   TORCH_SUITES_FILE_TIMEOUT  limit for one file's whole run (default 3600)
#   TORCH_SUITES_PYDEPS    folders prepended to PYTHONPATH (colon-separated)
#   TORCH_SUITES_SWITCH_ENV  extra VAR=VALUE words for the non-baseline runs
#   TORCH_SUITES_PYTEST_ARGS extra pytest arguments (e.g. -k ...)
#   TORCH_SUITES_EMIT=1    at the end, print the results folder as a base64
#                          tar.gz between marker lines: a Debian lane's chroot
#                          vanishes with its results, its stdout does not.
#                          `scripts/torch_suites.sh extract LOG DIR` unpacks it.
#
# A Debian lane (scripts/debian_lane.sh copies the checkout's tracked and
# untracked-not-ignored files, so the test files must sit in an untracked,
# not ignored folder of the checkout, e.g. torch_tests_tmp/):
#   TORCHSHM_LANE_COMMAND='TORCH_SUITES_EMIT=1 TORCH_SUITES_OUT=/tmp/ts
#     TORCH_SUITES_PYDEPS=$PWD/torch_tests_tmp/pydeps PYTHON=python
#     bash scripts/torch_suites.sh torch_tests_tmp/torch-1.13.1' \
#     scripts/debian_lane.sh 12 2>&1 | tee lane12.log
#   scripts/torch_suites.sh extract lane12.log results-debian12
set -euo pipefail

if [ "${1:-}" = extract ]; then  # extract LOG DIR
    mkdir -p "$3"
    sed -n '/^=== TORCH_SUITES_RESULTS_BEGIN ===$/,/^=== TORCH_SUITES_RESULTS_END ===$/p' "$2" |
        sed '1d;$d' | base64 -d | tar -xzf - -C "$3"
    echo "extracted into $3" >&2
    exit 0
fi

TESTS=$(cd "${1:?usage: $0 TESTS_DIR [baseline|default|switch|import|check]...}" && pwd)
shift
RUNS=("$@")
[ "${#RUNS[@]}" != 0 ] || RUNS=(baseline default)
PYTHON=${PYTHON:-python3}
OUT=${TORCH_SUITES_OUT:-$PWD/torch_suites_results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
read -r -a FILES <<<"${TORCH_SUITES_FILES:-test_multiprocessing.py test_dataloader.py}"
read -r -a SWITCH_ENV <<<"${TORCH_SUITES_SWITCH_ENV:-}"
read -r -a EXTRA_ARGS <<<"${TORCH_SUITES_PYTEST_ARGS:-}"
TIMEOUT=${TORCH_SUITES_TIMEOUT:-300}
FILE_TIMEOUT=${TORCH_SUITES_FILE_TIMEOUT:-3600}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

log() { printf '[torch_suites] %s\n' "$*" >&2; }

# --- generated helpers: a pytest.ini, a report plugin, the sitecustomize -----
HELP=$OUT/.helpers
mkdir -p "$HELP/plugin" "$HELP/site"
# An empty ini: the checkout's own pytest settings (testpaths, timeouts,
# filterwarnings) must not apply to torch's files.
printf '[pytest]\n' >"$HELP/pytest.ini"

cat >"$HELP/plugin/torch_suites_report.py" <<'EOF'
"""One JSON line per test and phase, appended as the run goes: a run killed
half-way keeps what it had."""
import json
import os

_out = None


def pytest_configure(config):
    global _out
    path = os.environ.get("TORCH_SUITES_REPORT")
    if path:
        _out = open(path, "a", buffering=1)


def pytest_runtest_logreport(report):
    if _out is None:
        return
    msg = ""
    if report.failed or report.skipped:
        crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
        if crash is not None:
            msg = crash.message
        elif isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
            msg = str(report.longrepr[2])
        else:
            text = report.longreprtext.strip().splitlines()
            msg = text[-1] if text else ""
    _out.write(json.dumps({
        "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
        "wasxfail": hasattr(report, "wasxfail"), "duration": round(report.duration, 3),
        "msg": msg[:400],
    }) + "\n")
EOF

cat >"$HELP/site/sitecustomize.py" <<'EOF'
"""torch_suites: `import torchshm` in every Python process that starts with
TORCHSHM_SUITE_IMPORT=1 or TORCHSHM_TENSORS=1 in its environment (spawned and
forkserver children inherit it; forked ones inherit the import). A
sitecustomize further on sys.path (Debian ships one) runs first."""
import os
import sys


def _chain():
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_chain()
if "1" in (os.environ.get("TORCHSHM_SUITE_IMPORT"), os.environ.get("TORCHSHM_TENSORS")):
    try:
        import torchshm  # noqa: F401
    except BaseException:
        # Python would only print "Error in sitecustomize" and go on without
        # torchshm: a run that looks switched on but is not. End it instead.
        import traceback

        traceback.print_exc()
        sys.stderr.write("torch_suites sitecustomize: import torchshm failed\n")
        sys.stderr.flush()
        os._exit(97)
EOF

cat >"$HELP/check_import.py" <<'EOF'
"""Checks that torchshm is imported at start-up in this process and in spawned,
forkserver and subprocess children."""
import multiprocessing as mp
import subprocess
import sys


def probe(q):
    q.put("torchshm" in sys.modules)


def main():
    results = {"parent": "torchshm" in sys.modules}
    for method in ("spawn", "forkserver", "fork"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=probe, args=(q,))
        p.start()
        results[method] = q.get(timeout=120)
        p.join(60)
    out = subprocess.run(
        [sys.executable, "-c", "import sys; print('torchshm' in sys.modules)"],
        capture_output=True, text=True, timeout=120,
    )
    results["subprocess"] = out.stdout.strip() == "True"
    import torchshm, torch, numpy
    print(f"import check: {results}; torchshm from {torchshm.__file__};"
          f" torch {torch.__version__}, numpy {numpy.__version__}")
    sys.exit(0 if all(results.values()) else 1)


if __name__ == "__main__":
    main()
EOF

cat >"$HELP/summarize.py" <<'EOF'
"""Counts per run and file, and the tests whose outcome differs from the
baseline's."""
import glob
import json
import os
import sys

out = sys.argv[1]
KINDS = ["passed", "failed", "skipped", "xfailed", "xpassed", "error"]


def outcomes(path):
    tests = {}
    for line in open(path):
        r = json.loads(line)
        t = tests.setdefault(r["nodeid"], {"outcome": None, "msg": "", "error": None})
        r["msg"] = (r["msg"].strip().splitlines() or [""])[0]
        if r["when"] == "call":
            o = r["outcome"]
            if r["wasxfail"]:
                o = "xfailed" if o == "skipped" else "xpassed"
            t["outcome"], t["msg"] = o, r["msg"]
        elif r["outcome"] == "skipped":  # a skip (or xfail) in setup
            t["outcome"] = "xfailed" if r["wasxfail"] else "skipped"
            t["msg"] = r["msg"]
        elif r["outcome"] == "failed":
            t["error"] = f"{r['when']}: {r['msg']}"
    final = {}
    for nodeid, t in tests.items():
        if t["error"]:
            final[nodeid] = ("error", t["error"])
        else:
            final[nodeid] = (t["outcome"] or "error", t["msg"])
    return final


runs = {}
for path in sorted(glob.glob(os.path.join(out, "*", "*.jsonl"))):
    run = os.path.basename(os.path.dirname(path))
    runs.setdefault(run, {})[os.path.basename(path)[:-6]] = outcomes(path)

lines = []
meta = {}
for path in glob.glob(os.path.join(out, "*", "*.meta")):
    run = os.path.basename(os.path.dirname(path))
    meta[(run, os.path.basename(path)[:-5])] = dict(
        l.strip().split("=", 1) for l in open(path) if "=" in l
    )
order = ["baseline"] + sorted(r for r in runs if r != "baseline")
for run in [r for r in order if r in runs]:
    for f, res in sorted(runs[run].items()):
        counts = {k: 0 for k in KINDS}
        for o, _ in res.values():
            counts[o] = counts.get(o, 0) + 1
        timeouts = sum(1 for o, m in res.values() if o in ("failed", "error") and "Timeout" in m)
        m = meta.get((run, f), {})
        lines.append(
            f"{run:9} {f:22} " + " ".join(f"{k}={counts[k]}" for k in KINDS)
            + f" timeouts={timeouts} wall={m.get('wall_s', '?')}s rc={m.get('rc', '?')}"
            + f" leftover={m.get('alive_at_exit', '?')}/{m.get('leftover_after_30s', '?')}"
        )
base = runs.get("baseline", {})
for run in [r for r in order if r in runs and r != "baseline"]:
    for f, res in sorted(runs[run].items()):
        b = base.get(f)
        if b is None:
            lines.append(f"{run} {f}: no baseline to compare with")
            continue
        diffs = []
        for nodeid in sorted(set(b) | set(res)):
            bo, bm = b.get(nodeid, ("missing", ""))
            ro, rm = res.get(nodeid, ("missing", ""))
            if bo != ro:
                diffs.append(f"  {nodeid}: {bo} -> {ro}  {rm or bm}"[:600])
        lines.append(f"{run} vs baseline, {f}: {len(diffs)} differing test(s)")
        lines.extend(diffs)
for run in [r for r in order if r in runs]:
    for f, res in sorted(runs[run].items()):
        bad = [(n, o, m) for n, (o, m) in sorted(res.items()) if o in ("failed", "error", "xpassed")]
        if bad:
            lines.append(f"{run} {f}: failed/error/xpassed tests:")
            lines.extend(f"  {n}: {o}  {m}"[:600] for n, o, m in bad)
text = "\n".join(lines) + "\n"
open(os.path.join(out, "summary.txt"), "w").write(text)
sys.stdout.write(text)
EOF

# --- the runs ---------------------------------------------------------------
join_path() { local IFS=:; echo "$*"; }

# The processes a run left behind (found by the run's marker in their
# environment): those still alive 30 s after pytest ended are reported and
# ended (TERM, then KILL). Prints "lingering leftover": how many were alive
# when pytest ended, and how many of those were still alive 30 s later.
marked_processes() {  # marked_processes MARKER
    local pid
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        [ "$pid" = $$ ] && continue
        { tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null |
            grep -qx "TORCH_SUITES_RUN_ID=$1" && echo "$pid"
    done
}

end_leftovers() {  # end_leftovers MARKER
    local pid pids first tries
    pids=$(marked_processes "$1")
    first=$(echo $pids | wc -w)
    for tries in $(seq 30); do
        [ -n "$pids" ] || break
        sleep 1
        pids=$(marked_processes "$1")
    done
    for pid in $pids; do
        log "leftover process $pid: $({ tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null | cut -c1-120)"
        kill -TERM "$pid" 2>/dev/null || true
    done
    [ -z "$pids" ] || sleep 5
    for pid in $pids; do kill -KILL "$pid" 2>/dev/null || true; done
    echo "$first $(echo $pids | wc -w)"
}

run_env() {  # run_env RUN: the environment of one run, as VAR=VALUE words
    local pypath=("$HELP/plugin")
    [ -z "${TORCH_SUITES_PYDEPS:-}" ] || pypath+=("$TORCH_SUITES_PYDEPS")
    case "$1" in
    baseline) ;;
    default) ENV_RUN=(TORCHSHM_SUITE_IMPORT=1 "${SWITCH_ENV[@]}")
        pypath=("$HELP/site" "${pypath[@]}") ;;
    switch) ENV_RUN=(TORCHSHM_TENSORS=1 TORCHSHM_SUITE_IMPORT=1 "${SWITCH_ENV[@]}")
        pypath=("$HELP/site" "${pypath[@]}") ;;
    import) ENV_RUN=(TORCHSHM_TENSORS=0 TORCHSHM_SUITE_IMPORT=1 "${SWITCH_ENV[@]}")
        pypath=("$HELP/site" "${pypath[@]}") ;;
    esac
    ENV_RUN+=("PYTHONPATH=$(join_path "${pypath[@]}")${PYTHONPATH:+:$PYTHONPATH}")
}

check_import() {  # check_import RUN
    ENV_RUN=()
    run_env "$1"
    log "$1: checking that every child imports torchshm"
    env -u CI "${ENV_RUN[@]}" "$PYTHON" "$HELP/check_import.py" 2>&1 | tee "$OUT/$1/import_check.txt"
}

run_file() {  # run_file RUN FILE
    local run=$1 file=$2 name=${2%.py} start rc=0 marker left wall
    local dir=$OUT/$run
    mkdir -p "$dir/cwd"
    rm -f "$dir/$name.jsonl"
    ENV_RUN=()
    run_env "$run"
    marker="$run-$name-$$-$RANDOM"
    log "$run: $file (per-test timeout ${TIMEOUT}s)"
    start=$(date +%s)
    # The scratch cwd keeps files tests write out of the checkout. CI and the
    # like would switch torch's test framework to CI behaviour; unset.
    (cd "$dir/cwd" && env -u CI -u GITHUB_ACTIONS -u PYTORCH_TEST_WITH_SLOW \
        -u TORCHSHM_TENSORS -u TORCHSHM_SUITE_IMPORT -u TORCHSHM_DISABLE \
        "${ENV_RUN[@]}" TORCH_SUITES_REPORT="$dir/$name.jsonl" \
        TORCH_SUITES_RUN_ID="$marker" PYTHONDONTWRITEBYTECODE=1 \
        PYTORCH_PRINT_REPRO_ON_FAILURE=0 \
        timeout -k 30 "$FILE_TIMEOUT" "$PYTHON" -m pytest -p no:cacheprovider \
        -p torch_suites_report -c "$HELP/pytest.ini" --rootdir "$TESTS" \
        --timeout "$TIMEOUT" -rA -q "${EXTRA_ARGS[@]}" "$TESTS/$file") \
        >"$dir/$name.log" 2>&1 || rc=$?
    wall=$(($(date +%s) - start))
    left=$(end_leftovers "$marker")
    printf 'wall_s=%s\nrc=%s\nalive_at_exit=%s\nleftover_after_30s=%s\n' \
        "$wall" "$rc" "${left% *}" "${left#* }" >"$dir/$name.meta"
    log "$run: $file done in $wall s, pytest rc $rc: $(tail -n 1 "$dir/$name.log")"
}

[[ " ${RUNS[*]} " =~ \ (baseline|default|switch|import)\  ]] && {
    echo "python: $("$PYTHON" -c 'import sys, torch, numpy; print(sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__)' 2>&1 | tail -n 1)"
    echo "tests: $TESTS"
    if git -C "$REPO" rev-parse HEAD >/dev/null 2>&1; then
        echo "torchshm: $(git -C "$REPO" rev-parse --short HEAD), diff $(git -C "$REPO" diff HEAD | sha256sum | cut -c1-12), untracked $(git -C "$REPO" ls-files -o --exclude-standard | wc -l)"
    fi
} >>"$OUT/lane.txt"
for run in "${RUNS[@]}"; do
    case "$run" in
    baseline | default | switch | import) ;;
    check) mkdir -p "$OUT/switch"; check_import switch; continue ;;
    summary) continue ;;
    *) log "unknown run $run"; exit 2 ;;
    esac
    mkdir -p "$OUT/$run"
    if [ "$run" != baseline ] && ! check_import "$run"; then
        log "$run: torchshm is not imported in every child; not running it"
        exit 1
    fi
    for f in "${FILES[@]}"; do
        run_file "$run" "$f"
    done
done
"$PYTHON" "$HELP/summarize.py" "$OUT"
if [ "${TORCH_SUITES_EMIT:-}" = 1 ]; then
    echo "=== TORCH_SUITES_RESULTS_BEGIN ==="
    tar -C "$OUT" --exclude=./.helpers --exclude='*/cwd' -czf - . | base64
    echo "=== TORCH_SUITES_RESULTS_END ==="
fi

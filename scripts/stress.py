"""The long SIGKILL stress run (GitHub issue 5).

Batches of rounds, each batch a driver in a torchshm session of its own
(tests/fault_children.py `kill`): per round a parent forks a sender and a
receiver joined by a pipe, and one of the three is SIGKILLed at a random
moment. Between batches the driver that founded a session is itself killed
mid-run. Each driver is a long-lived parent that imported torchshm: at the
end of its rounds, while it still lives, whatever its dead children held must
be gone within seconds (live_leftovers). After every driver, once its
session's processes are gone, its keeper must have exited holding no
segment, and no process of it may run. Then `--pool-rounds` rounds of
`with ctx.Pool(3) as p: p.map(...)` under fork, each bounded by a watchdog:
Pool.terminate() must end its workers as promptly as without torchshm.

    .venv/bin/python scripts/stress.py --batches 20 --rounds 100 --root-kills 20 \
        --pool-rounds 500

Prints one line per driver and the totals; exits 1 on any leftover, lost,
corrupted or hung message.
"""

import argparse
import os
import random
import select
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import isolated  # noqa: E402

COUNTS = ("rounds", "kills", "messages", "lost", "bad", "errors", "hung")
FAILURES = (
    "leftovers",
    "lost",
    "bad",
    "errors",
    "hung",
    "early_leftovers",
    "live_leftovers",
    "pool_hangs",
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POOL_LOOP = """
import multiprocessing as mp, sys
import numpy as np
import torchshm

def work(i):
    return np.full(100_000, float(i))

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    for r in range(int(sys.argv[1])):
        with ctx.Pool(3) as pool:
            assert [float(a[0]) for a in pool.map(work, range(3))] == [0, 1, 2]
        print(r, flush=True)
"""
POOL_ROUND_SECONDS = 60


def batch(rounds, seed):
    """A driver running `rounds` rounds to the end."""
    with isolated.Driver("kill", str(rounds), str(seed), timeout=3600) as driver:
        lines, status = driver.results()
        if status != 0 or not lines:
            driver.fail(f"driver exited with {status}")
        counts = lines[-1]
        counts.update(_leftovers(driver))
    return counts


def root_kill(rng, seed):
    """A driver killed by SIGKILL after a random number of rounds."""
    with isolated.Driver("kill", "100000", str(seed), timeout=600) as driver:
        rows = [driver.readline() for _ in range(rng.randint(0, 4))]
        time.sleep(rng.uniform(0, 0.2))
        driver.kill()
        counts = dict.fromkeys(COUNTS, 0)
        counts["kills"] = 1
        for row in filter(None, rows):
            row = isolated.json.loads(row)
            counts["rounds"] += 1
            counts["kills"] += row["victim"] is not None
            counts["messages"] += row["received"]
            for key in ("lost", "bad", "errors", "hung"):
                counts[key] += row[key]
        counts.update(_leftovers(driver))
    return counts


def pool_rounds(rounds):
    """Runs `rounds` `with Pool` rounds in a fresh process; a round that does
    not finish within POOL_ROUND_SECONDS is a hang (the process is killed and
    the rest run in a new one). Returns (rounds run, hangs)."""
    done = hangs = 0
    while done + hangs < rounds:
        proc = subprocess.Popen(
            [sys.executable, "-c", POOL_LOOP, str(rounds - done - hangs)],
            stdout=subprocess.PIPE,
            cwd=ROOT,
            text=True,
        )
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], POOL_ROUND_SECONDS)
            if not ready:
                hangs += 1
                proc.kill()
                break
            if not proc.stdout.readline():
                break  # finished (or failed: counted below)
            done += 1
        proc.wait()
        proc.stdout.close()
        if proc.returncode not in (0, -9):
            raise SystemExit(f"the pool loop failed with {proc.returncode}")
    return done, hangs


def _leftovers(driver):
    segments, processes = isolated.leftovers(driver)
    return {"leftovers": len(segments) + len(processes)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=100, help="per batch")
    parser.add_argument("--root-kills", type=int, default=10)
    parser.add_argument("--pool-rounds", type=int, default=500)
    parser.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    args = parser.parse_args()
    os.environ.setdefault("TORCHSHM_THRESHOLD", "1")
    rng = random.Random(args.seed)
    print(f"seed {args.seed}", flush=True)
    totals = dict.fromkeys(COUNTS + FAILURES + ("pending_sweep",), 0)
    started = time.monotonic()
    jobs = ["batch"] * args.batches + ["root"] * args.root_kills
    rng.shuffle(jobs)
    for n, job in enumerate(jobs):
        seed = rng.randrange(1 << 30)
        counts = batch(args.rounds, seed) if job == "batch" else root_kill(rng, seed)
        for key in totals:
            totals[key] += counts.get(key, 0)
        shown = " ".join(f"{k}={counts.get(k, 0)}" for k in COUNTS + ("leftovers",))
        print(f"{n + 1}/{len(jobs)} {job:5} seed={seed} {shown}", flush=True)
    pools, totals["pool_hangs"] = pool_rounds(args.pool_rounds)
    print(f"with Pool: {pools} rounds, {totals['pool_hangs']} hung", flush=True)
    minutes = (time.monotonic() - started) / 60
    print(
        f"TOTAL rounds={totals['rounds']} kills={totals['kills']}"
        f" messages={totals['messages']} leftovers={totals['leftovers']}"
        f" lost={totals['lost']} (bad={totals['bad']} errors={totals['errors']}"
        f" hung={totals['hung']} early_leftovers={totals['early_leftovers']}"
        f" live_leftovers={totals['live_leftovers']};"
        f" left for reapers={totals['pending_sweep']});"
        f" with Pool rounds={pools} hung={totals['pool_hangs']} in {minutes:.1f} min",
        flush=True,
    )
    return 1 if any(totals[k] for k in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())

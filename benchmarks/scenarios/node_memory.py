"""8. Node memory: 4 torch.distributed ranks x 2 DataLoader workers, one table.

Four ranks on this machine (gloo, torchrun's environment contract; see
benchmarks/node_rank.py) each get the table and start 2 workers that read all
of it. While every process holds it, the launcher sums, over ranks and
workers, the PSS of the mapping that holds the table in each process: PSS
splits a shared page among the processes that map it, so the sum is what the
table costs the node.
"""

import os
import shutil
import tempfile

from benchmarks import node_rank
from benchmarks.report import Result

NAME = "node_memory"
WORLD = 4
MODES = ("plain", "share_on_node_fork", "share_on_node_spawn")


def measure(mode, nbytes):
    """(table PSS summed over ranks and workers, slowest rank's setup s)."""
    status = tempfile.mkdtemp(prefix="torchshm-node-")
    procs = node_rank.launch([mode, nbytes, status], WORLD)
    try:
        ready = node_rank.wait_ready(status, procs)
        pss = sum(
            node_rank.mapping_pss(pid, address, nbytes)
            for rank in ready
            for pid, address in rank["holders"]
        )
        open(os.path.join(status, "go"), "w").close()
        for proc in procs:
            rc = proc.wait(120)
            if rc != 0:
                raise RuntimeError(f"a rank failed: {proc.stderr.read()[-3000:]}")
        return pss, max(rank["setup_s"] for rank in ready)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stderr.close()
        shutil.rmtree(status, ignore_errors=True)


def run(quick, bar):
    nbytes = (64 << 20) if quick else (1 << 30)
    case = f"{WORLD} ranks x {node_rank.WORKERS} workers"
    result = Result(
        NAME,
        f"8. {nbytes >> 20} MiB table on {WORLD} ranks x {node_rank.WORKERS}"
        " DataLoader workers: node memory (table PSS, all processes)",
        unit="B",
        notes=[
            "plain: each rank builds its own table, fork workers share it"
            " copy-on-write (plain loading's best case; spawn workers would"
            " each unpickle a copy of their own).",
            "share_on_node_*: torchshm.distributed.share_on_node builds it"
            " once per node; fork or spawn workers. One run each (memory is"
            " deterministic). Ideal: one table.",
        ],
    )
    bar.reset(total=len(MODES))
    for mode in MODES:
        pss, setup = measure(mode, nbytes)
        result.add(case, mode, [pss], warmup=0)
        result.extra(case, f"{mode} setup s", round(setup, 2))
        bar.update()
    copies = {m: result.get(case, m)["median"] / nbytes for m in MODES}
    result.summary["table_copies"] = copies
    result.notes.append(
        "Table copies: " + ", ".join(f"{m} {c:.2f}" for m, c in copies.items())
    )
    return result

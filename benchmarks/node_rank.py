"""Ranks of a torch.distributed job for the node_memory scenario, and their
launcher.

`python benchmarks/node_rank.py MODE NBYTES STATUS_DIR` is one rank (started
by `launch` with torchrun's environment contract; Debian's torchrun is broken,
see ../shared/notes/facts.md section 8). It gets a table of NBYTES, starts 2
DataLoader workers that each read all of it, writes STATUS_DIR/ready.RANK
(the pids of itself and its workers, and where the table lies in each), and
waits for STATUS_DIR/go. MODE:

- plain: every rank builds its own table (no torchshm imported); fork
  workers, which share it copy-on-write (plain loading's best case: spawn
  workers would each get a pickled copy).
- share_on_node_fork, share_on_node_spawn: torchshm.distributed.share_on_node
  builds it once per node; fork or spawn workers.

Runs as a script, not from the benchmarks package: the plain ranks must not
import torchshm (the package's scenarios do).
"""

import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, world):
    """Starts `world` ranks of this script on one node, as torchrun would."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    env.pop("TORCHSHM_SESSION", None)  # each rank its own session, as torchrun's
    procs = []
    for rank in range(world):
        rank_env = dict(
            env,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            GROUP_RANK="0",
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(world),
            GROUP_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            USE_LIBUV="0",
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, *map(str, args)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=rank_env,
            )
        )
    return procs


def wait_ready(status_dir, procs, seconds=300):
    deadline = time.monotonic() + seconds
    found = {}
    while len(found) < len(procs):
        for rank, proc in enumerate(procs):
            path = os.path.join(status_dir, f"ready.{rank}")
            if rank in found:
                continue
            if os.path.exists(path):
                with open(path) as f:
                    found[rank] = json.load(f)
            elif proc.poll() is not None:
                raise RuntimeError(
                    f"rank {rank} exited ({proc.returncode}):"
                    f" {proc.stderr.read()[-3000:]}"
                )
        if time.monotonic() > deadline:
            raise TimeoutError("ranks not ready")
        time.sleep(0.1)
    return [found[r] for r in range(len(procs))]


def mapping_pss(pid, address, nbytes):
    """PSS in bytes of the mappings of process `pid` that overlap
    [address, address + nbytes): one table may span several (numpy asks for
    huge pages from the first aligned address on, which splits its mapping)."""
    inside, total = False, 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0] if line.strip() else ""
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < address + nbytes and address < hi
            elif head == "Pss:" and inside:
                total += int(line.split()[1]) * 1024
    return total


class Touch:
    """Items 0..WORKERS-1: read the whole table (one per worker); later items
    wait for STATUS_DIR/go (the launcher measures meanwhile)."""

    def __init__(self, table, status_dir):
        self.table, self.status_dir = table, status_dir

    def __len__(self):
        return 2 * WORKERS

    def __getitem__(self, i):
        if i < WORKERS:
            address = self.table.__array_interface__["data"][0]
            return os.getpid(), address, float(self.table.sum())
        while not os.path.exists(os.path.join(self.status_dir, "go")):
            time.sleep(0.05)
        return None


def rank_main(mode, nbytes, status_dir):
    import numpy as np
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")

    def build():
        return np.full(nbytes // 8, 1.0)

    start = time.perf_counter()
    if mode == "plain":
        table, context, init = build(), "fork", None
    else:
        import torchshm
        import torchshm.distributed as tsd

        table = tsd.share_on_node(build=build)
        context, init = mode.rsplit("_", 1)[1], torchshm.worker_init_fn
    setup = time.perf_counter() - start
    loader = DataLoader(
        Touch(table, status_dir),
        batch_size=None,
        num_workers=WORKERS,
        multiprocessing_context=context,
        worker_init_fn=init,
    )
    it = iter(loader)
    workers = [next(it) for _ in range(WORKERS)]
    assert all(total == nbytes // 8 for _, _, total in workers), workers
    ready = {
        "setup_s": setup,
        "holders": [[os.getpid(), table.__array_interface__["data"][0]]]
        + [[pid, address] for pid, address, _ in workers],
    }
    path = os.path.join(status_dir, f"ready.{rank}")
    with open(path + ".tmp", "w") as f:
        json.dump(ready, f)
    os.rename(path + ".tmp", path)
    list(it)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

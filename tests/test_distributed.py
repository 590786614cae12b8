"""torchshm.distributed.share_on_node across real torch.distributed ranks.

Debian's torchrun is broken on this stack (../shared/notes/facts.md, section
8), so `launch` starts the ranks the way torchrun does: one process per rank
with torchrun's environment contract, env:// rendezvous, gloo. Each rank is
its own torchshm session, as under torchrun. The rank program is
`tests/node_children.py rank`.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.test_handles import ROOT, child_env, wait_gone
from torchshm._tools import doctor as _doctor

# torch and the OS only: not the newest lane (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = pytest.mark.torch_os

# Three ranks: the owner (killed) and two survivors still sharing one copy.
# The table is big enough to dwarf the pool's own chunks in the PSS sums.
WORLD = 3
TABLE = 128 << 20


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, world=WORLD, nodes=1):
    """Starts `world` ranks of `python -m tests.node_children *args` with
    torchrun's environment contract (`nodes` groups of world // nodes)."""
    port = free_port()
    per_node = world // nodes
    procs = []
    for rank in range(world):
        env = dict(
            child_env(),
            RANK=str(rank),
            LOCAL_RANK=str(rank % per_node),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(per_node),
            GROUP_RANK=str(rank // per_node),
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(world),
            GROUP_WORLD_SIZE=str(nodes),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_RUN_ID="torchshm-test",
            USE_LIBUV="0",
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.node_children", *map(str, args)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env=env,
            )
        )
    return procs


def wait_files(status_dir, name, ranks, procs, seconds):
    deadline = time.monotonic() + seconds
    found = {}
    while len(found) < len(ranks):
        for rank in ranks:
            path = os.path.join(status_dir, f"{name}.{rank}")
            if rank not in found and os.path.exists(path):
                with open(path) as f:
                    found[rank] = json.load(f)
        for rank, proc in enumerate(procs):
            if rank in ranks and rank not in found and proc.poll() is not None:
                raise AssertionError(
                    f"rank {rank} exited ({proc.returncode}):"
                    f" {proc.stderr.read()[-3000:]}"
                )
        if time.monotonic() > deadline:
            raise AssertionError(f"no {name} from ranks {set(ranks) - set(found)}")
        time.sleep(0.1)
    return found


def run_job(tmp_path, mode, kill_rank=None):
    """(PSS of torchshm memory over all ranks and workers / table, sessions)."""
    status = tmp_path / mode
    status.mkdir()
    procs = launch(["rank", mode, TABLE, status])
    sessions = set()
    try:
        ready = wait_files(status, "ready", range(WORLD), procs, 150)
        sessions = {r["session"] for r in ready.values()}
        pids = [p for r in ready.values() for p in [r["pid"], *r["workers"]]]
        assert len(set(pids)) == WORLD * 3
        pss = sum(_doctor.segment_pss(pid) for pid in pids)
        if kill_rank is not None:
            procs[kill_rank].send_signal(signal.SIGKILL)
            procs[kill_rank].wait(30)
        (status / "go").touch()
        survivors = [r for r in range(WORLD) if r != kill_rank]
        done = wait_files(status, "done", survivors, procs, 120)
        assert all(d["sums_ok"] for d in done.values())
        for rank, proc in enumerate(procs):
            rc = proc.wait(60)
            err = proc.stderr.read()
            if rank == kill_rank:
                assert rc == -signal.SIGKILL
            else:
                assert rc == 0, err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
    return pss / TABLE, sessions


@pytest.mark.timeout(400)
def test_share_on_node_one_copy_per_node_and_a_killed_rank(tmp_path):
    copies, sessions = run_job(tmp_path, "share_on_node", kill_rank=0)
    print(f"share_on_node: {copies:.3f} tables of PSS over {WORLD} ranks x 2 workers")
    assert copies < 1.3
    assert len(sessions) == WORLD  # each rank its own session, as torchrun's
    # Rank 0 (the owner) was killed: its workers exit, its reaper sweeps.
    assert wait_gone(sessions, 30) == []

    control, sessions = run_job(tmp_path, "per_rank")
    print(f"control (torchshm.share per rank): {control:.3f} tables")
    assert control > WORLD - 0.2
    assert wait_gone(sessions, 30) == []

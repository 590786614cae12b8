"""The peers in `make bench` (benchmarks/peers.py): a peer that cannot be
imported shows its error in the table instead of a silently missing column;
PEERS=0 drops them; where Ray, Grain and tensordict are installed (`make
bench` installs them), they measure."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests import isolated

# the same on every stack: the pip lane only (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = pytest.mark.any_stack

PEER_PACKAGES = ("ray", "grain", "tensordict")
MISSING = [p for p in PEER_PACKAGES if importlib.util.find_spec(p) is None]


def bench(tmp_path, only, env=(), pythonpath=(), timeout=600):
    """`python -m benchmarks --quick --only ONLY`'s JSON scenarios."""
    out = tmp_path / "results.json"
    environ = dict(os.environ, **dict(env))
    environ["PYTHONPATH"] = os.pathsep.join([*pythonpath, isolated.ROOT])
    environ.pop("TORCHSHM_THRESHOLD", None)  # as users get it
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--no-progress"]
        + ["--only", only, "--json", str(out), "--plot", ""],
        capture_output=True,
        text=True,
        cwd=isolated.ROOT,
        env=environ,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())["scenarios"], run.stdout


PLANTED = """
from benchmarks import peers
from benchmarks.report import Result, markdown
result = Result("t", "t")
for method in ("ray", "tensordict", "torch_fs"):
    samples = peers.attempt(result, ["a", "b"], method, lambda: [1.0, 2.0])
    if samples is not None:
        result.add("a", method, samples)
print(markdown(result))
"""


@pytest.mark.timeout(300)
def test_a_peer_that_cannot_be_imported_shows_its_error(tmp_path):
    planted = tmp_path / "planted"
    for package in ("ray", "tensordict"):
        (planted / package).mkdir(parents=True)
        (planted / package / "__init__.py").write_text(
            f"raise ImportError('planted: no {package} here')\n"
        )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(planted), isolated.ROOT]))
    run = subprocess.run(
        [sys.executable, "-c", PLANTED],
        capture_output=True,
        text=True,
        cwd=isolated.ROOT,
        env=env,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    table = run.stdout
    rows = [line for line in table.splitlines() if line.startswith("| a ")]
    (row,) = rows
    assert row.count("failed") == 2, table  # ray and tensordict, not torch_fs
    assert "planted: no ray here" in table and "planted: no tensordict here" in table


@pytest.mark.timeout(600)
def test_peers_off_drops_their_columns(tmp_path):
    # era5: Ray, Grain and torch_fs where peers are on, 4 s at --quick.
    (scenario,), table = bench(tmp_path, "era5", env={"TORCHSHM_BENCH_PEERS": "0"})
    methods = {row["method"] for row in scenario["rows"]}
    assert methods and not methods & {"ray", "joblib", "torch_fs", "tensordict"}
    assert scenario["failures"] == [] and "Peers:" not in table


@pytest.mark.skipif(bool(MISSING), reason=f"optional dependency missing: {MISSING}")
@pytest.mark.timeout(1800)
def test_the_peers_measure_beside_torchshm(tmp_path):
    # Ray, Grain and joblib start daemons and workers: on a busy 2-core
    # machine (a Debian lane beside the suite) this ran past 600 s.
    scenarios, _ = bench(tmp_path, "big_array,era5,dataloader", timeout=1500)
    measured = {s["name"]: {r["method"] for r in s["rows"]} for s in scenarios}
    assert all(s["failures"] == [] for s in scenarios), scenarios
    assert {"ray", "joblib", "torch_fs", "tensordict"} <= measured["big_array"]
    assert {"ray", "grain", "torch_fs"} <= measured["era5"]
    assert "grain" in measured["dataloader"]
    for scenario in scenarios:
        ratios = [e for e in scenario["extras"].values() if "best peer" in e]
        assert ratios, f"{scenario['name']} compares torchshm with no peer"

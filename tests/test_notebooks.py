"""The notebooks are stored with the outputs of a reference run
(scripts/run_notebooks.py), and run again here, at quick sizes, through
nbclient so that they cannot rot."""

import re
from pathlib import Path

import pytest

from tests.conftest import script

# the same on every stack: the pip lane only (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = pytest.mark.any_stack

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


# scripts/run_notebooks.py stores the notebooks' outputs: the tests run them
# the same way.
run_notebooks = script("run_notebooks")


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory):
    return run_notebooks.kernel_path(tmp_path_factory.mktemp("jupyter"))


def test_notebooks_exist():
    names = {path.name for path in NOTEBOOKS}
    assert {"quickstart.ipynb", "benchmarks.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebooks_are_stored_with_their_outputs(path):
    """Opened without running (on a code host, in the docs), a notebook shows
    what it printed and plotted: every code cell ran in the stored run (an
    import cell prints nothing), none failed, and a notebook that plots
    shows its plots."""
    notebook = nbformat.read(path, as_version=4)
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    unrun = [i for i, c in enumerate(cells) if c.execution_count is None]
    assert not unrun, f"{path.name}: code cells {unrun} were not run"
    assert any(c.outputs for c in cells), f"{path.name} is stored without outputs"
    outputs = [o for c in cells for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], path.name
    if any("plt." in c.source or ".plot(" in c.source for c in cells):
        images = [o for o in outputs if "image/png" in o.get("data", {})]
        assert images, f"{path.name} plots, but no plot is stored"


# A machine's own paths, as a stored output would show them.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:root|home|work|tmp|opt|usr/lib)/")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_stored_outputs_hold_no_stderr_path_or_traceback(path):
    notebook = nbformat.read(path, as_version=4)
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    stderr = [o for o in outputs if o.get("name") == "stderr"]
    assert not stderr, f"{path.name}: stored stderr: {stderr[0].get('text', '')[:200]}"
    for output in outputs:
        text = output.get("text", "") + "".join(
            value
            for key, value in output.get("data", {}).items()
            if key.startswith("text/")
        )
        assert "Traceback" not in text, f"{path.name}: a traceback: {text[:300]}"
        found = MACHINE_PATH.search(text)
        where = text[max(0, found.start() - 80) : found.end() + 80] if found else ""
        assert not found, f"{path.name}: a machine path: {where}"


def test_a_planted_path_or_traceback_is_caught():
    assert MACHINE_PATH.search("see /work/main/.venv/lib/python3.11/x.py")
    assert MACHINE_PATH.search(
        'Traceback (most recent call last):\n  File "/root/a.py"'
    )
    assert not MACHINE_PATH.search("docs/guide/install.md and 1.2 GB/s")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.name)
def test_notebook_runs(path, jupyter_path, monkeypatch):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:  # what this run prints, not the stored run's
        if cell.cell_type == "code":
            cell.outputs = []

    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_path))
    monkeypatch.setenv("TORCHSHM_BENCH_QUICK", "1")
    # The peers (Ray's daemons among them) are measured by `make bench` and
    # tests/test_bench_peers.py; the notebook runs without them here.
    monkeypatch.setenv("TORCHSHM_BENCH_PEERS", "0")
    # conftest lowers the threshold for the other tests; the notebooks show
    # (and benchmark) torchshm as users get it.
    monkeypatch.delenv("TORCHSHM_THRESHOLD", raising=False)
    run_notebooks.execute(notebook, path, timeout=180)
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors

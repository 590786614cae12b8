"""Runs the notebooks and stores them with their outputs (plots included), so
that they show results when opened without running them.

    .venv/bin/python scripts/run_notebooks.py [notebooks/NAME.ipynb ...]

Each runs at the sizes a user gets (no TORCHSHM_BENCH_QUICK unless it is set),
with this interpreter as its kernel; the first cell's output names the
machine where a notebook measures. Timing metadata is dropped so that a rerun
changes only what it measured. tests/test_notebooks.py runs them again at
quick sizes, without saving.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def kernel_path(root):
    """A `python3` kernelspec under `root` that runs this interpreter, for
    JUPYTER_PATH (searched first): Debian's own kernelspec runs
    /usr/bin/python3, which does not see the venv's torchshm."""
    spec = Path(root) / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "Python 3", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    return str(root)


def execute(notebook, path, timeout):
    """Runs `notebook` (an nbformat node) in place, in its own folder."""
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=timeout,
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError with the failing cell
    return notebook


def noise(output):
    """What a stored notebook must not show: its stderr (progress bars'
    redraws, libraries' notices such as Ray's or tqdm's, each naming files
    of this machine). A cell's results are its stdout, tables and plots."""
    return output.get("output_type") == "stream" and output.get("name") == "stderr"


def main(paths):
    with tempfile.TemporaryDirectory() as root:
        os.environ["JUPYTER_PATH"] = kernel_path(root)
        # The threshold and the peers as users get them.
        os.environ.pop("TORCHSHM_THRESHOLD", None)
        for path in paths or NOTEBOOKS:
            path = Path(path).resolve()
            notebook = nbformat.read(path, as_version=4)
            print(f"running {path.relative_to(ROOT)}", flush=True)
            execute(notebook, path, timeout=3600)
            for cell in notebook.cells:
                if cell.cell_type == "code":
                    cell.outputs = [o for o in cell.outputs if not noise(o)]
            notebook.metadata.pop("widgets", None)
            nbformat.write(notebook, path)


if __name__ == "__main__":
    main(sys.argv[1:])

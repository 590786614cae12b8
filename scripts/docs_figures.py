"""The docs' figures from one reference run of `make bench`.

    make bench                                  # writes benchmarks/results/results.json
    .venv/bin/python scripts/docs_figures.py    # -> docs/figures/, README's figure

Writes docs/figures/<scenario>.png for every scenario with numbers,
docs/figures/headline.png (the README's figure: a 400 MB array from a child,
and a DataLoader epoch) docs/figures/reference-run.md (every figure with
its caption, included by docs/benchmarks.md) and docs/figures/results.json
(the run, which the notebooks show). Each caption, and the foot of
each image, names the machine, the date and the commit of the run. A
`--quick` run is refused: the docs show full sizes.
"""

import argparse
import json
import os
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import report  # noqa: E402

FIGURES = ROOT / "docs" / "figures"
README = ROOT / "README.md"
# The README's figure sits between these two lines, written by this script.
README_START = "<!-- figure: written by scripts/docs_figures.py -->"
README_END = "<!-- end of figure -->"


def provenance(run):
    machine = run["machine"]
    return (
        f"`make bench`, {run.get('date') or 'date unknown'}, commit"
        f" {run.get('commit') or 'unknown'}; {machine['cores']} cores"
        f" ({machine['cpu']}), {machine['memory']} RAM, Python"
        f" {machine['python']}, torch {machine['torch']}, NumPy {machine['numpy']}"
    )


def _stamp(fig, run):
    fig.text(
        0.005, 0.005, provenance(run).replace("`", ""), fontsize=6.5, color="#555555"
    )


def _bars(ax, result, case, title):
    """Horizontal bars of one case's medians, fastest on top, torchshm's red."""
    rows = [r for r in result.rows if r["case"] == case]
    rows.sort(key=lambda r: r["median"], reverse=True)
    labels = [report.label(result.name, r["method"]) for r in rows]
    values = [r["median"] for r in rows]
    colors = [report.color(r["method"]) for r in rows]
    ax.barh(labels, values, color=colors)
    for y, value in enumerate(values):
        ax.text(value, y, f" {report.fmt(value, 's')}", va="center", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(right=max(values) * 6)
    ax.set_xlabel("time, log scale (lower is better)")
    report.times_on(ax.xaxis)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(True, axis="x", which="both", alpha=0.3)


def headline(run, results):
    big, loader = results["big_array"], results["dataloader"]
    cases = loader.cases()
    workers = "2 workers" if "2 workers" in cases else cases[-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    _bars(left, big, "steady (sends 2..N)", "400 MB array, child -> parent, sends 2..N")
    _bars(right, loader, workers, f"DataLoader epoch, 512 x 1 MiB, {workers}")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    _stamp(fig, run)
    return fig


def write(run):
    FIGURES.mkdir(parents=True, exist_ok=True)
    results = {
        record["name"]: report.Result.from_json(record) for record in run["scenarios"]
    }
    fig = headline(run, results)
    fig.savefig(FIGURES / "headline.png", dpi=110)
    plt.close(fig)
    for name, result in results.items():
        if not result.rows:  # a table of words (scenario 15)
            continue
        fig = report.plot(result)
        # The legend beside the axes, where it hides no bar.
        fig.set_size_inches(11, 5)
        for ax in fig.axes:
            if ax.get_legend() is not None:
                ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        _stamp(fig, run)
        fig.savefig(FIGURES / f"{name}.png", dpi=110)
        plt.close(fig)
    return list(results.values())


def scrolling_tables(markdown):
    """`markdown` with each table in a `<div class="scrolls">`: wide, they
    scroll sideways instead of wrapping every cell (docs/_static/torchshm.css).
    Plain Markdown and HTML, so the page reads on a code host too."""
    out, table = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            out += ['<div class="scrolls">', "", *table, "", "</div>"]
            table = []
        if line.startswith("- "):  # a note: `__getitem__` is no bold text
            line = line.replace("__", "\\_\\_")
        out.append(line)
    return out


def reference_page(run, results):
    """Each scenario's table (as `make bench` prints it), then its figure."""
    lines = [
        "<!-- Written by scripts/docs_figures.py from one run of `make bench`. -->",
        "",
        f"Every table and figure below is from one run: {provenance(run)}.",
        "Cells: median [min-max] and the ratio to pipe + pickle.",
        "",
    ]
    for result in results:
        lines += scrolling_tables(report.markdown(result))
        if result.rows:
            lines += [
                f"![{result.title}]({result.name}.png)",
                "",
                f"*Scenario {result.title}. {provenance(run)}.*",
                "",
            ]
    (FIGURES / "reference-run.md").write_text("\n".join(lines))


def readme_figure(run):
    text = README.read_text()
    pattern = re.compile(re.escape(README_START) + ".*?" + re.escape(README_END), re.S)
    if not pattern.search(text):
        sys.exit(f"{README}: no {README_START!r} ... {README_END!r} lines")
    figure = "\n".join(
        [
            README_START,
            "![A 400 MB array from a child process, and a DataLoader epoch, for"
            " each method](docs/figures/headline.png)",
            "",
            f"<sub>{provenance(run)}. Every number: "
            "[the benchmark report](docs/benchmarks.md) (this run's tables and"
            " figures: [docs/figures/reference-run.md]"
            "(docs/figures/reference-run.md)).</sub>",
            README_END,
        ]
    )
    README.write_text(pattern.sub(lambda _: figure, text))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "results",
        nargs="?",
        default=str(ROOT / "benchmarks" / "results" / "results.json"),
    )
    args = parser.parse_args(argv)
    run = json.loads(Path(args.results).read_text())
    if run["args"].get("quick"):
        sys.exit(f"{args.results}: a --quick run; the docs show a full one")
    missing = {"big_array", "dataloader"} - {s["name"] for s in run["scenarios"]}
    if missing:
        sys.exit(f"{args.results}: no {', '.join(sorted(missing))} scenario")
    results = write(run)
    # The run itself: the notebooks show it (notebooks/benchmarks.ipynb).
    (FIGURES / "results.json").write_text(json.dumps(run, indent=1) + "\n")
    reference_page(run, results)
    readme_figure(run)
    plotted = sum(1 for r in results if r.rows)
    print(f"{plotted + 1} figures in {os.path.relpath(FIGURES, ROOT)}")


if __name__ == "__main__":
    main()

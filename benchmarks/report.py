"""Statistics, the results table, JSON and plots: the only place numbers are
summarized or formatted, so every scenario reports the same way."""

import json
import os
import platform
import re
import statistics
import subprocess
import time

from benchmarks.transports import LABELS

BASELINE = "pipe"


def summarize(samples, warmup=1):
    """Median, min and max of the samples after the first `warmup` ones (the
    first send pays one-time costs; it is kept as `first`)."""
    steady = samples[warmup:] if len(samples) > warmup else samples
    return {
        "median": statistics.median(steady),
        "min": min(steady),
        "max": max(steady),
        "n": len(steady),
        "first": samples[0],
        "samples": list(samples),
    }


class Result:
    """One scenario's measurements: a value per (case, method), plus
    per-case extra columns. `unit` is "s" or "B"; lower is better."""

    def __init__(self, name, title, unit="s", notes=()):
        self.name, self.title, self.unit = name, title, unit
        self.notes = list(notes)
        self.rows = []  # dicts: case, method, median, min, max, n, first, samples
        self.extras = {}  # case -> {column: value}
        self.summary = {}  # scenario-level conclusions, e.g. the crossover
        self.failures = {}  # (case, method) -> why it has no value

    def add(self, case, method, samples, warmup=1):
        row = {"case": case, "method": method, **summarize(samples, warmup)}
        self.rows.append(row)
        return row

    def fail(self, case, method, why):
        """A method that could not run on a case: its column stays in the
        table with "failed", and the notes say why (once per reason)."""
        self.failures[(case, method)] = why
        note = f"{LABELS.get(method, method)}: {why}"
        if note not in self.notes:
            self.notes.append(note)

    def get(self, case, method):
        for row in self.rows:
            if row["case"] == case and row["method"] == method:
                return row
        return None

    def cases(self):
        cases = [row["case"] for row in self.rows] + [c for c, _ in self.failures]
        return list(dict.fromkeys(cases + list(self.extras)))

    def methods(self):
        methods = [row["method"] for row in self.rows]
        return list(dict.fromkeys(methods + [m for _, m in self.failures]))

    def ratio(self, case, method, against=BASELINE):
        row, base = self.get(case, method), self.get(case, against)
        if row is None or base is None or not base["median"]:
            return None
        return row["median"] / base["median"]

    def extra(self, case, column, value):
        self.extras.setdefault(case, {})[column] = value

    @classmethod
    def from_json(cls, record):
        """A Result as `to_json` wrote it (scripts/docs_figures.py plots a
        stored run)."""
        result = cls(record["name"], record["title"], record["unit"], record["notes"])
        result.rows = record["rows"]
        result.extras = record["extras"]
        result.summary = record["summary"]
        result.failures = {
            (f["case"], f["method"]): f["why"] for f in record["failures"]
        }
        return result

    def to_json(self):
        for row in self.rows:
            row["ratio_vs_pipe"] = self.ratio(row["case"], row["method"])
        return {
            "name": self.name,
            "title": self.title,
            "unit": self.unit,
            "notes": self.notes,
            "rows": self.rows,
            "extras": self.extras,
            "summary": self.summary,
            "failures": [
                {"case": c, "method": m, "why": why}
                for (c, m), why in self.failures.items()
            ],
        }


def fmt(value, unit):
    if value is None:
        return "n/a"
    if unit == "B":
        for scale, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if abs(value) >= scale:
                return f"{value / scale:.2f} {suffix}"
        return f"{value:.0f} B"
    if unit == "s":
        for scale, suffix in ((1, "s"), (1e-3, "ms"), (1e-6, "us")):
            if abs(value) >= scale or suffix == "us":
                digits = 3 - len(str(int(abs(value) / scale)))
                return f"{value / scale:.{max(0, digits)}f} {suffix}"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


# One colour per method, the same in every figure: torchshm's ways in reds
# and oranges, torch's in purples, the peers in blues and greens, pickling
# through a pipe in greys. A method missing here gets a colour of tab20 by
# its name (stable too).
COLORS = {
    "torchshm": "#d62728",
    "torchshm_shared": "#ff7f0e",
    "torchshm_always": "#e377c2",
    "torchshm_collate": "#8c564b",
    "torchshm_born": "#bcbd22",
    "torchshm_initializer": "#ff9896",
    "torch_torchshm": "#f7b6d2",
    "torch": "#9467bd",
    "torch_again": "#dbc8e8",
    "torch_fs": "#c5b0d5",
    "pipe": "#7f7f7f",
    "pipe_again": "#c7c7c7",
    "shm_pickle5": "#17becf",
    "ray": "#1f77b4",
    "joblib": "#2ca02c",
    "grain": "#98df8a",
    "tensordict": "#aec7e8",
}


# What a method is in a scenario that gives it another meaning: in the
# DataLoader scenarios "torchshm" is np.stack's batch sent through torchshm.
SCENARIO_LABELS = {
    "dataloader": {
        "pipe": "np.stack, pickled",
        "torchshm": "np.stack + torchshm",
        "torch": "default collate, torch",
        "torch_torchshm": "default collate via torchshm",
    },
    "docker_shm": {
        "torchshm": "np.stack + torchshm",
        "torch": "default collate, torch",
        "torch_tensors": "default collate via torchshm",
        "tensor_samples": "tensor samples, torch",
        "tensor_samples_tensors": "tensor samples via torchshm",
        "pipe": "np.stack, pickled",
    },
    "dataloader_scale": {
        "torchshm": "np.stack + torchshm",
        "torch": "default collate, torch",
        "torch_torchshm": "default collate via torchshm",
        "torch_again": "default collate, torch again (A/A)",
    },
}


def label(result_name, method):
    """What `method` is called in scenario `result_name`'s tables and figures."""
    own = SCENARIO_LABELS.get(result_name, {})
    return own.get(method) or LABELS.get(method, method)


def color(method):
    """`method`'s colour in every figure."""
    if method in COLORS:
        return COLORS[method]
    import matplotlib

    index = sum(method.encode()) % 20
    return matplotlib.colormaps["tab20"](index)


def ordered(methods):
    """torchshm's methods first (after the row label, where a reader looks),
    then the others in their order."""
    ours = [m for m in methods if "torchshm" in m]
    return ours + [m for m in methods if m not in ours]


def one_line(note):
    """A note on one line: a child's error with its traceback becomes its
    first line and the exception at its end (no paths of the machine)."""
    lines = [line.strip() for line in note.splitlines() if line.strip()]
    errors = [line for line in lines[1:] if re.match(r"\w+(Error|Exception)\b", line)]
    if len(lines) <= 1:
        return note
    return f"{lines[0]} ... {errors[-1]}" if errors else lines[0]


def markdown(result):
    """The scenario as a markdown table: one row per case, one column per
    method with `median [min-max] ratio-to-pipe`, torchshm's first, then the
    extra columns."""
    methods = ordered(result.methods())
    columns = list(dict.fromkeys(c for e in result.extras.values() for c in e))
    lines = [
        f"### {result.title}",
        "",
        "| case | "
        + " | ".join([label(result.name, m) for m in methods] + columns)
        + " |",
        "|---" * (1 + len(methods) + len(columns)) + "|",
    ]
    for case in result.cases():
        cells = [case]
        for method in methods:
            row = result.get(case, method)
            if row is None:
                cells.append("failed" if (case, method) in result.failures else "")
                continue
            ratio = result.ratio(case, method)
            cell = (
                f"{fmt(row['median'], result.unit)} "
                f"[{fmt(row['min'], result.unit)}-{fmt(row['max'], result.unit)}]"
            )
            if method != BASELINE and ratio is not None:
                cell += f" {ratio:.2f}x"
            cells.append(cell)
        for column in columns:
            cells.append(fmt(result.extras.get(case, {}).get(column), None))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"- {one_line(note)}" for note in result.notes]
    return "\n".join(lines) + "\n"


def machine():
    """What the numbers were measured on."""
    import numpy
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if "model name" in ln)
    except (OSError, StopIteration):
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory": fmt(memory, "B") if memory else "unknown",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
    }


def machine_line(info):
    return (
        f"{info['cpu']}, {info['cores']} cores, {info['memory']} RAM, "
        f"Linux {info['kernel']}, Python {info['python']}, torch {info['torch']}, "
        f"numpy {info['numpy']}"
    )


def commit():
    """The checkout's commit ("+" when it has changes), or None outside git."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        return subprocess.run(
            ["git", "-C", root, *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


def write_json(results, path, info, args):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {
                "machine": info,
                "date": time.strftime("%Y-%m-%d", time.gmtime()),
                "commit": commit(),
                "args": args,
                "scenarios": [r.to_json() for r in results],
            },
            f,
            indent=1,
        )


def plot(result, ax=None):
    """One figure per scenario: median with min-max bars, log scale.

    Per-case lines when cases are sizes (per_item), grouped bars otherwise.
    Returns the matplotlib Figure.
    """
    import matplotlib

    if ax is None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 5))
    else:
        fig = ax.figure
    if "lines" in result.summary:
        return _plot_lines(result, result.summary["lines"], ax)
    cases, methods = result.cases(), ordered(result.methods())
    in_bytes = result.unit == "B"
    scale = (1 << 30) if in_bytes else 1  # bytes are shown in GiB
    x = list(range(len(cases)))
    width = 0.8 / max(1, len(methods))
    failed_at = []  # (x, label) of each run that failed: marked, not blank
    for i, method in enumerate(methods):
        rows = [result.get(case, method) for case in cases]
        xs = [j for j, row in zip(x, rows) if row]
        med = [row["median"] / scale for row in rows if row]
        err = [
            [(row["median"] - row["min"]) / scale for row in rows if row],
            [(row["max"] - row["median"]) / scale for row in rows if row],
        ]
        name = label(result.name, method)
        offset = [v - 0.4 + width * (i + 0.5) for v in xs]
        if result.name == "per_item":
            ax.errorbar(
                xs,
                med,
                yerr=err,
                marker="o",
                ms=3,
                capsize=2,
                label=name,
                color=color(method),
            )
        else:
            ax.bar(
                offset,
                med,
                width,
                yerr=err,
                capsize=2,
                label=name,
                color=color(method),
            )
        failed_at += [
            (j - 0.4 + width * (i + 0.5), method)
            for j, case in zip(x, cases)
            if _failed(result, case, method)
        ]
    ax.set_xticks(x)
    # Cases that are methods (scenario 12's) by what they are too.
    names = [label(result.name, c) for c in cases]
    ax.set_xticklabels(names, rotation=30 if len(cases) > 4 else 0, ha="right")
    if in_bytes:  # GiB on a linear axis: a copy more is a bar twice as tall
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_ylabel("GiB (lower is better)")
    else:
        ax.set_yscale("log")
        ax.set_ylabel("time, log scale (lower is better)")
        times_on(ax.yaxis)
    for at, method in failed_at:
        ax.plot(
            at,
            0.02,
            marker="x",
            ms=8,
            color=color(method),
            transform=ax.get_xaxis_transform(),
            clip_on=False,
        )
        ax.text(
            at,
            0.06,
            "failed",
            rotation=90,
            fontsize=7,
            ha="center",
            va="bottom",
            color="#333333",
            transform=ax.get_xaxis_transform(),
        )
    ax.set_title(result.title)
    ax.grid(True, which="both", axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def times_on(axis):
    """A log axis of seconds labelled as times ("60 ms", "1.5 s"), on the
    ticks matplotlib would label, not as powers of ten."""
    import matplotlib

    class Times(matplotlib.ticker.LogFormatter):
        def __call__(self, v, pos=None):
            return fmt(v, "s") if super().__call__(v, pos) else ""

    axis.set_major_formatter(Times())
    axis.set_minor_formatter(Times())


def _failed(result, case, method):
    """Whether `method`'s run of `case` failed: recorded so, or none of its
    runs completed (a "completed (<method>)" column of 0/n)."""
    completed = str(result.extras.get(case, {}).get(f"completed ({method})", ""))
    return (case, method) in result.failures or completed.startswith("0/")


def _plot_lines(result, lines, ax):
    """A scenario's own series against x (summary["lines"]): one line each,
    styled by lines["styles"] (matplotlib keywords per label), a series
    without a value at some x skips it; values in bytes are shown in GiB."""
    import matplotlib

    x = lines["x"]
    scale = (1 << 30) if result.unit == "B" else 1
    for label, values in lines["series"].items():
        points = [(a, v / scale) for a, v in zip(x, values) if v is not None]
        if points:
            style = {"marker": "o", "ms": 4, **lines.get("styles", {}).get(label, {})}
            ax.plot(*zip(*points), label=label, **style)
    if result.unit == "B":
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xticks(x)
    ax.set_xlabel(lines["xlabel"])
    ax.set_ylabel(lines["ylabel"])
    ax.set_ylim(bottom=0)
    ax.set_title(result.title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure


def write_plots(results, directory):
    """A PNG per scenario. Call before anything imports pyplot to get the
    file-only Agg backend (the CLI does; a notebook keeps its own)."""
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for result in results:
        if not result.rows:  # a table of words (scenario 15): nothing to plot
            continue
        fig = plot(result)
        path = os.path.join(directory, f"{result.name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths

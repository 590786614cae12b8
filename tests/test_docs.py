"""The docs cannot rot unseen between `make docs` runs (CI builds the site
with every warning an error; these run in `make test`): the README stays a
landing page with its figure, the README's and the DataLoader guide's
examples run and print what their pages quote, every relative link in the
README and the docs' Markdown resolves, every measured figure a page quotes is
the reference run's or its section names its own run, and the API page names
every public name once."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TIMEOUT, script

# the same on every stack: the pip lane only (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = pytest.mark.any_stack

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"] + sorted(
    p for p in DOCS.rglob("*.md") if "_build" not in p.parts
)
# [text](target) and ![alt](target), outside code blocks.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def links(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]


def test_the_readme_is_a_landing_page_with_its_figure():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    figures = re.findall(r"!\[[^\]]*\]\((docs/figures/[^)]+\.png)\)", readme)
    assert figures and all((ROOT / f).is_file() for f in figures), figures


# A page's runnable example: the page, where the example starts (its first
# Python block from there), and the line it prints, which the page quotes.
EXAMPLES = {
    "README.md": ("## Example", r"400 MB in \d+\.\d\d s, shared memory: True"),
    "docs/guide/dataloader.md": (
        "# DataLoader",
        r"8 batches of \(32, 3, 224, 224\) in \d+\.\d\d s, shared memory: True",
    ),
}


def _run_example(code, tmp_path):
    """Runs a page's example as a user would: a script of its own, in a
    fresh directory, without this suite's TORCHSHM_* settings."""
    (tmp_path / "example.py").write_text(code)
    run = subprocess.run(
        [sys.executable, "example.py"],
        capture_output=True,
        text=True,
        timeout=2 * TIMEOUT,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("TORCHSHM_")},
    )
    assert run.returncode == 0, run.stderr
    return run


@pytest.mark.parametrize("page", EXAMPLES)
def test_the_example_runs_and_prints_what_its_page_says(page, tmp_path):
    start, printed = EXAMPLES[page]
    text = (ROOT / page).read_text()
    example = text[text.index(start) :]
    code, after = re.search(r"```python\n(.*?)```(.*)", example, re.S).groups()
    run = _run_example(code, tmp_path)
    assert re.fullmatch(printed + r"\n", run.stdout), run.stdout
    said = re.search(r"it prints `([^`]*)`", " ".join(after.split()))
    assert said and re.fullmatch(
        printed, said.group(1)
    ), f"{page} quotes a line the example does not print"


def test_the_getting_started_counts_print_what_the_page_shows(tmp_path):
    # Its "See what it did" example, and the ```text block after it.
    text = (ROOT / "docs/guide/getting-started.md").read_text()
    section = text[text.index("## See what it did") :]
    code, shown = re.search(
        r"```python\n(.*?)```.*?```text\n(.*?)```", section, re.S
    ).groups()
    run = _run_example(code, tmp_path)
    assert run.stdout == shown


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    missing = [
        target
        for target in links(page)
        if not (page.parent / target.split("#")[0]).exists()
    ]
    assert not missing, f"{page.relative_to(ROOT)}: {missing}"
    # The site has no page for the reference run's tables: benchmarks.md
    # shows them in place (docs/conf.py), so a site page links there.
    if DOCS in page.parents and page != DOCS / "benchmarks.md":
        into = [t for t in links(page) if (page.parent / t).resolve() == REFERENCE_RUN]
        assert (
            not into
        ), f"{page.relative_to(ROOT)}: link benchmarks.md#the-reference-run"


# A measured figure: a number (or a range or list of them) and a unit of time
# or throughput. Sizes and counts are what a scenario is, not what it measured.
NUMBER = r"\d+(?:\.\d+)?"
FIGURE = re.compile(
    rf"(?<![\w.])({NUMBER}(?:\s*(?:/|-|to)\s*{NUMBER})*)\s*(ms|us|µs|s|GB/s)(?![\w/])"
)
# A setting's value, as pages quote it: "(`TORCHSHM_KEEPER_TIMEOUT`, 5 s)".
SETTING = re.compile(r"\(`TORCHSHM_\w+`[^)]*\)")
# A section that reports a run of its own says how and when: a command in
# backticks and the run's date. A run of the benchmark suite's scenarios is
# no run of its own: their figures are the reference run's, so that no two
# pages quote one scenario differently; a run of its own measures what the
# suite does not (a micro-benchmark, the build, an example script).
OWN_RUN = (
    re.compile(r"`[^`\n]*(?:python|make |scripts/|benchmarks)[^`\n]*`"),
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),
)
SCENARIO_RUN = re.compile(r"make bench|python -m benchmarks(?:\s|$)")
REFERENCE_RUN = DOCS / "figures" / "reference-run.md"


def figures(text):
    """(value, unit, as written) of each measured figure outside code blocks."""
    text = SETTING.sub("", re.sub(r"```.*?```", "", text, flags=re.S))
    for match in FIGURE.finditer(text):
        unit = "us" if match.group(2) == "µs" else match.group(2)
        for number in re.findall(NUMBER, match.group(1)):
            yield float(number), unit, " ".join(match.group(0).split())


# A table column whose header names its unit: "GB/s torchshm", "share() s".
UNIT_COLUMN = re.compile(r"^GB/s\b|\b(s)$")


def column_figures(text):
    """(value, unit) of the plain numbers in table columns whose header
    names the unit (the reference run writes GB/s and seconds so)."""
    header = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not line.startswith("|---"):
            for name, cell in zip(header, cells):
                unit = UNIT_COLUMN.search(name)
                if unit and re.fullmatch(NUMBER, cell):
                    yield float(cell), "s" if unit.group(1) else "GB/s"


def unheld_figures(text, reference):
    """The figures of sections that name no run of their own and that the
    reference run does not hold, with their section's heading."""
    held = {(value, unit) for value, unit, _ in figures(reference)}
    held |= set(column_figures(reference))
    return [
        (section.splitlines()[0], written)
        for section in re.split(r"\n(?=#+ )", text)
        if not names_its_own_run(section)
        for value, unit, written in figures(section)
        if (value, unit) not in held
    ]


def names_its_own_run(section):
    """Whether `section` names a run of its own (see OWN_RUN), not one of the
    benchmark suite's scenarios."""
    commands = [
        c for c in OWN_RUN[0].findall(section) if not SCENARIO_RUN.search(c.strip("`"))
    ]
    return bool(commands) and bool(OWN_RUN[1].search(section))


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if p != REFERENCE_RUN],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_figure_is_the_reference_runs_or_names_its_run(page):
    unheld = unheld_figures(page.read_text(), REFERENCE_RUN.read_text())
    assert not unheld, (
        f"{page.relative_to(ROOT)} quotes figures that docs/figures/reference-run.md"
        f" does not hold, in sections that name no run of their own: {unheld}"
    )


def test_a_stale_figure_is_caught_and_a_named_run_may_quote_its_own():
    reference = "| first send | 192 ms [190 ms-201 ms] | 5.71 GB/s |"
    stale = "# Containers\n\nAn epoch takes 602 ms in 64 MiB; 192 ms here.\n"
    assert unheld_figures(stale, reference) == [("# Containers", "602 ms")]
    assert unheld_figures("# A\n\n15.6 / 192 ms, 5.71 GB/s\n", reference) == [
        ("# A", "15.6 / 192 ms")
    ]
    named = stale + "\n(`python -m benchmarks.micro sender`, 2026-11-28.)\n"
    assert unheld_figures(named, reference) == []
    # A scenario of the suite is the reference run's, whatever run a page names.
    scenario = stale + "\n(`python -m benchmarks --only 12`, 2026-11-28.)\n"
    assert unheld_figures(scenario, reference) == [("# Containers", "602 ms")]
    assert unheld_figures("# B\n\n(`TORCHSHM_X`, 30 s idle)\n", reference) == []
    # A column that names its unit holds its plain numbers in that unit.
    columns = (
        "| case | GB/s torchshm | share() s |\n|---|---|---|\n| a | 14.71 | 0.85 |\n"
    )
    assert unheld_figures("# C\n\n14.71 GB/s, 0.85 s, 14.71 s\n", columns) == [
        ("# C", "14.71 s")
    ]


def test_the_api_page_names_every_public_name_once():
    named = {}
    module = None
    for line in (DOCS / "api.rst").read_text().splitlines():
        if m := re.match(r"\.\. torchshm-api:: (\S+)", line):
            module = m.group(1)
        elif m := re.match(r"\s+:names:(.*)", line):
            for name in m.group(1).split():
                key = f"{module}.{name}"
                named[key] = named.get(key, 0) + 1
    public = {  # what `make docs` renders (modules have sections of their own)
        f"{module}.{entry['name']}"
        for module, info in script("api_dump").dump()["modules"].items()
        for entry in info["names"]
    }
    assert set(named) == public, (public - set(named), set(named) - public)
    assert all(count == 1 for count in named.values()), named

"""Texts that point at code stay true after code moves: every `Note [X]` a
comment or page refers to is defined on a line of its own (where the Notes
index finds it), in the file the reference names if it names one, and no
comment, docstring or page names a project path that does not exist. A
planted stale reference fails each check."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The folders a project path starts with, from the repository's root.
TOP = (
    ".ci/",
    "benchmarks/",
    "csrc/",
    "docs/",
    "notebooks/",
    "requirements/",
    "scripts/",
    "tests/",
    "torchshm/",
)
ROOT_FILES = ("Makefile", "README.md", "pyproject.toml", "setup.py")
TEXT_SUFFIXES = {".cpp", ".h", ".py", ".md", ".sh", ".toml", ".txt", ".ipynb", ""}
# A Note is defined by a line that holds only `Note [Title]` (after a comment
# marker or a docstring's quotes): docs/_ext/torchshm_docs.py reads the same.
NOTE_DEFINITION = re.compile(r"^\s*(?://|#|\"\"\")?\s*Note \[([^\]\n]+)\]\s*$", re.M)
# A reference, and the file it names if it names one ("... in csrc/base/gil.h").
NOTE_REFERENCE = re.compile(
    r"Note \[([^\]]+)\](?:,?\s*(?:#|//)?\s*(?:in|of)\s+(?:(?:#|//)\s*)?`?([\w./]+)`?)?"
)
PATH = re.compile(
    r"(?<![\w/.<'\"-])((?:\.\./)*(?:[\w.-]+/)*[\w-]+"
    r"\.(?:py|cpp|h|md|sh|ipynb|txt|toml))\b"
)
# A placeholder in a path (scripts/NAME.py), not a file. A quoted name is a
# string of code (a temporary file a test writes), not a reference.
PLACEHOLDER = re.compile(r"[A-Z]{3,}")


# Build outputs and environments, in a copy of the tree without git (the
# Debian lanes test such a copy of the tracked and untracked files).
NOT_SOURCES = {".git", ".venv", "build", "_build", "__pycache__", "results"}


def tracked():
    """The project's text files: git's list, or in a copy without git, every
    file but build outputs."""
    try:
        listing = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True
        )
    except FileNotFoundError:  # no git at all (the Debian 13 lane's root)
        listing = None
    if listing is not None and listing.returncode == 0:
        listed = listing.stdout.split()
    else:
        listed = [
            path.relative_to(ROOT).as_posix()
            for path in ROOT.rglob("*")
            if not any(
                part in NOT_SOURCES or part.endswith(".egg-info")
                for part in path.relative_to(ROOT).parts
            )
        ]
    return [
        path
        for path in listed
        if (ROOT / path).is_file()
        and Path(path).suffix in TEXT_SUFFIXES
        and not path.startswith("tests/data/")
        and path != "tests/test_texts.py"  # its planted references
    ]


def note_definitions(texts):
    """{title: the files that define it}."""
    defined = {}
    for path, text in texts.items():
        if path.endswith((".cpp", ".h", ".py")):
            for title in NOTE_DEFINITION.findall(text):
                defined.setdefault(title, set()).add(path)
    return defined


def title_of(reference):
    """A title as written across comment lines or string literals, on one line."""
    joined = re.sub(r"\"\s*\"", "", re.sub(r"\n\s*(?:#|//|\*)?", " ", reference))
    return " ".join(joined.split())


def stale_note_references(texts):
    defined = note_definitions(texts)
    stale = []
    for path, text in texts.items():
        for match in NOTE_REFERENCE.finditer(text):
            title, where = title_of(match.group(1)), match.group(2)
            if "{" in title or title == "Title":  # the Notes index's own template
                continue
            if title not in defined:
                stale.append(
                    (path, f"Note [{title}] is defined nowhere on a line of its own")
                )
                continue
            where = (where or "").rstrip(".")
            if ("/" in where or where.endswith((".py", ".h", ".cpp"))) and not any(
                d == where or d.endswith("/" + where) for d in defined[title]
            ):
                stale.append(
                    (
                        path,
                        f"Note [{title}] is in {sorted(defined[title])}, not {where}",
                    )
                )
    return stale


def missing_paths(texts, files):
    """Project paths named in texts that name no file: from the root
    (csrc/..., README.md), relative to the text (../guide/x.md), or a bare
    module name (_pool.py, segment.h) that no file of the tree has."""
    names = {Path(f).name for f in files}
    missing = []
    for path, text in texts.items():
        text = re.sub(r"#\s*include\s*<[^>]*>", "", text)  # system headers
        for named in PATH.findall(text):
            if PLACEHOLDER.search(named):
                continue
            if named.startswith("../"):
                if not (ROOT / named).resolve().is_relative_to(ROOT):
                    continue  # beside the project (../shared/notes/facts.md)
                exists = ((ROOT / path).parent / named).exists()
            elif named.startswith(TOP) or named in ROOT_FILES:
                exists = (ROOT / named).exists()
            elif "/" not in named and (
                named.startswith("_") or re.fullmatch(r"[a-z_]+\.(h|cpp)", named)
            ):
                exists = named in names
            else:
                continue  # another project's file (torch's test/...), a temporary one
            if not exists:
                missing.append((path, named))
    return missing


def texts_of(files):
    return {path: (ROOT / path).read_text(errors="replace") for path in files}


def test_every_note_reference_finds_its_note():
    stale = stale_note_references(texts_of(tracked()))
    assert not stale, "\n".join(f"{path}: {why}" for path, why in stale)


def test_every_project_path_named_exists():
    files = tracked()
    missing = missing_paths(texts_of(files), files)
    assert not missing, "\n".join(f"{path} names {named}" for path, named in missing)


def test_a_planted_stale_reference_fails_each_check():
    files = tracked()
    texts = texts_of(files)
    # csrc/base/gil.h defines Note [The GIL at exit] (tests/test_exit.py points at it).
    assert "csrc/base/gil.h" in note_definitions(texts)["The GIL at exit"]
    planted = {
        "csrc/planted.cpp": "// Note [The GIL at exit] in csrc/lifetime/segment.h\n"
        "// see Note [A Note nobody wrote].\n"
        "// Note [Inline]: a Note defined inside a sentence is not found.\n"
        "// see Note [Inline], and torchshm/_pool.py and _attach.py.\n"
    }
    stale = stale_note_references({**texts, **planted})
    assert [why for path, why in stale if path == "csrc/planted.cpp"] == [
        "Note [The GIL at exit] is in ['csrc/base/gil.h'], not csrc/lifetime/segment.h",
        "Note [A Note nobody wrote] is defined nowhere on a line of its own",
        "Note [Inline] is defined nowhere on a line of its own",
        "Note [Inline] is defined nowhere on a line of its own",
    ]
    assert missing_paths(planted, files) == [
        ("csrc/planted.cpp", "torchshm/_pool.py"),
        ("csrc/planted.cpp", "_attach.py"),
    ]

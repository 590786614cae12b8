"""Every public name is documented, and its examples run.

The API reference (docs/api.rst, scripts/api_dump.py) is generated from these
docstrings, so a public name without one would be a hole in the docs. The
docstrings use NumPy's sections (Parameters, Returns, Raises, Examples) and
every example runs through doctest in a fresh interpreter.
"""

import inspect
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import script

# The modules whose __all__ the API reference documents.
MODULES = script("api_dump").MODULES
PUBLIC = [
    (f"{module.__name__}.{name}", getattr(module, name))
    for module in MODULES
    for name in module.__all__
]
CALLABLES = [(n, o) for n, o in PUBLIC if inspect.isfunction(o)]
CLASSES = [(n, o) for n, o in PUBLIC if inspect.isclass(o)]
MEMBERS = [
    (f"{name}.{member}", value)
    for name, cls in CLASSES
    for member, value in vars(cls).items()
    if not member.startswith("_")
]


def sections(doc):
    """{title: body} of a NumPy-style docstring."""
    lines = inspect.cleandoc(doc).splitlines()
    found, title = {}, None
    for i, line in enumerate(lines):
        underline = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and re.fullmatch(r"-{3,}", underline.strip()):
            title = line.strip()
            found[title] = []
        elif title and not re.fullmatch(r"-{3,}", line.strip()):
            found[title].append(line)
    return {t: "\n".join(body) for t, body in found.items()}


def parameters(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    params = list(inspect.signature(target).parameters.values())
    return [
        ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "")
        + p.name
        for p in params
        if p.name != "self"
    ]


def test_the_public_names_are_found():
    assert len(CALLABLES) >= 25 and len(CLASSES) == 3, (CALLABLES, CLASSES)


@pytest.mark.parametrize("name, obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_every_public_name_has_its_own_docstring(name, obj):
    assert obj.__doc__ and obj.__doc__.strip(), f"{name} has no docstring"


@pytest.mark.parametrize("name, obj", CALLABLES, ids=[n for n, _ in CALLABLES])
def test_every_function_documents_parameters_returns_raises_and_an_example(name, obj):
    found = sections(obj.__doc__ or "")
    wanted = ["Returns", "Raises", "Examples"]
    if parameters(obj):
        wanted.insert(0, "Parameters")
    missing = [title for title in wanted if title not in found]
    assert not missing, f"{name}: no {', '.join(missing)} section"
    for param in parameters(obj):
        entry = rf"^\s*{re.escape(param)}\s*:"
        assert re.search(entry, found["Parameters"], re.M), f"{name}: {param}?"
    assert ">>>" in found["Examples"], f"{name}: the example has no >>> line"


@pytest.mark.parametrize("name, cls", CLASSES, ids=[n for n, _ in CLASSES])
def test_every_class_documents_its_parameters_and_an_example(name, cls):
    found = sections(cls.__doc__ or "")
    assert ">>>" in found.get("Examples", ""), f"{name}: no example"
    for param in parameters(cls):
        assert param in found.get("Parameters", ""), f"{name}: {param}?"


@pytest.mark.parametrize("name, member", MEMBERS, ids=[n for n, _ in MEMBERS])
def test_every_public_member_has_a_docstring(name, member):
    doc = getattr(member, "__doc__", None)
    assert doc and doc.strip(), f"{name} has no docstring"


DOCTESTS = textwrap.dedent(
    """
    import doctest, importlib, sys
    import numpy as np
    import torchshm
    failed = 0
    for qualified in sys.argv[1:]:
        module, _, name = qualified.rpartition(".")
        obj = getattr(importlib.import_module(module), name)
        globs = {"np": np, "torchshm": torchshm}
        finder = doctest.DocTestFinder(recurse=False)
        for test in finder.find(obj, qualified, globs=globs):
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
            runner.run(test)
            failed += runner.failures
    sys.exit(1 if failed else 0)
    """
)


def test_the_examples_run():
    """In a fresh interpreter: an example may register, share or allocate."""
    names = [n for n, o in PUBLIC if not inspect.ismodule(o)]
    result = subprocess.run(
        [sys.executable, "-c", DOCTESTS, *names],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]

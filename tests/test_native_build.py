"""What keeps the native build cheap (setup.py's translation_units): csrc/
uses torch's API through torch_api.h, never all of torch, and it compiles as
two translation units, so no two of its files may define the same name."""

import pathlib
import re

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"

# Headers that bring in all of torch's C++ API, or its Python variable
# internals: each added 7-20 s of parse to every file that included it.
HEAVY = re.compile(
    r"#include\s*<(torch/extension\.h|torch/torch\.h|torch/all\.h|ATen/ATen\.h"
    r"|torch/csrc/autograd/python_variable\.h)>"
)

# A function defined at namespace scope: a line that starts with its return
# type and ends its parameter list with a body, not a declaration's `;`.
DEFINITION = re.compile(
    r"^(?:(?:static|inline|constexpr|\[\[\w+\]\])\s+)*[A-Za-z_][\w:<>*&, ]*?[\s*&]"
    r"([A-Za-z_]\w*)\((?![^)]*\)\s*(?:const\s*)?;)"
)


def defined_names(path):
    names = set()
    for line in path.read_text().splitlines():
        found = DEFINITION.match(line)
        # Members (Segment::fill) belong to their class, declared once.
        if found and "::" not in line.split("(")[0].split()[-1]:
            names.add(found.group(1))
    return names


def test_csrc_includes_torch_api_not_all_of_torch():
    heavy = {
        path.name: match.group(1)
        for path in sorted(CSRC.rglob("*.[ch]*"))
        for match in [HEAVY.search(path.read_text())]
        if match
    }
    assert heavy == {}, "include csrc/base/torch_api.h (or add what you need to it)"


def test_the_definitions_are_found():
    # The scan below finds definitions of each kind it is meant to.
    assert {"weak_ref", "referent"} <= defined_names(CSRC / "lifetime" / "live.cpp")
    assert "copy_extent" in defined_names(CSRC / "base" / "ndarray.cpp")


def test_no_two_files_of_csrc_define_the_same_name():
    # In one translation unit, a helper private to each of two files is a
    # redefinition, or an overload that the second file's calls may pick
    # silently. Overloads within one file are fine.
    owners = {}
    for path in sorted(CSRC.rglob("*.cpp")):
        for name in defined_names(path):
            owners.setdefault(name, []).append(path.name)
    twice = {name: files for name, files in owners.items() if len(files) > 1}
    assert twice == {}, "rename one, or share one definition through a header"

"""The import graph of torchshm/: no cycle, counting imports inside
functions too (a cycle that only a lazy import hides still ties two modules
into one, issue 23), and the wings' rule (which module may import which)."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchshm"


def module_name(path):
    """torchshm.PKG.MOD for torchshm/PKG/MOD.py; a package's __init__.py is the
    package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules():
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path, known):
    """torchshm's own modules that `path` imports, anywhere in it: `from
    torchshm._send import sender` imports the module torchshm._send.sender."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "torchshm" or node.module.startswith("torchshm."):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("torchshm."))
    return found


def import_graph():
    modules = all_modules()
    # The package itself re-exports everything; edges into it are not design.
    return {
        name: sorted(
            m
            for m in imported_modules(path, modules)
            if m in modules and m not in (name, "torchshm")
        )
        for name, path in modules.items()
        if name != "torchshm"
    }


def find_cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a"]}) is None


def test_the_import_graph_of_torchshm_has_no_cycle():
    graph = import_graph()
    assert "torchshm._dataloader" in graph and graph["torchshm.torchdata"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def native_importers():
    """Modules of torchshm/ that import the native extension itself (not
    through the seam, torchshm._native)."""
    found = set()
    for name, path in all_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "torchshm":
                if any(alias.name == "_C" for alias in node.names):
                    found.add(name)
            elif isinstance(node, ast.ImportFrom) and node.module == "torchshm._C":
                found.add(name)
            elif isinstance(node, ast.Import):
                if any(a.name == "torchshm._C" for a in node.names):
                    found.add(name)
    return found


def test_exactly_one_module_imports_the_native_extension():
    # Note [The seam] in torchshm/_native.py.
    assert native_importers() == {"torchshm._native"}


def test_the_native_stub_is_generated_from_the_native_module():
    import subprocess
    import sys

    script = PACKAGE.parent / "scripts" / "stubgen.py"
    result = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# C++ calls into Python other than the hooks (csrc/base/config.h), by file: the
# protocols of the objects torchshm moves, each named in Note [The seam].
# module.cpp sets the module's own attributes, which calls nothing.
CALLS_INTO_PYTHON = {
    "item_reader.cpp": 2,
    "message.cpp": 5,
    "rebuild.cpp": 3,
    "views.cpp": 1,
}


def test_cxx_calls_into_python_only_where_the_seam_note_says():
    csrc = PACKAGE.parent / "csrc"
    call = re.compile(r"PyObject_Call\w*\(|\.attr\(")
    found = {}
    for path in sorted(csrc.rglob("*.[ch]*")):
        if path.name in ("config.cpp", "module.cpp"):
            continue
        n = len(call.findall(path.read_text()))
        if n:
            found[path.name] = n
    assert found == CALLS_INTO_PYTHON, (
        "a call from C++ into Python: route it through a hook (csrc/base/config.h)"
        " or name it in Note [The seam] (torchshm/_native.py), then here"
    )


# The wings' rule. The top level holds what users and pickles name and the
# base every wing uses; the engine lives in wings. Rooms stand in layers, and
# a module imports only its own room, the base, and the rooms below its own:
#   keeper    _keeper/: its facts (paths, layout, protocol), standard
#             library only: anyone may read them; its daemon is a program of
#             its own, which nobody imports
#   base      the seam, compat, config, stats, fallback, memory, version
#   cuda      _cuda/: the CUDA seam, and its fake for tests
#   lifetime  _lifetime/: sessions, segments, pools, attach, expiry, fork
#   wire      the rebuilds every message names (_reduction, _strings)
#   send      _send/: the reducers, their registration, the writers
#   features  what users make and pickles name (SharedList, handles, the
#             DataLoader helpers, SharedDict's keys): they never move
#   tools     _tools/: the report and the doctor
#   face      the package's public modules and share()
LAYERS = [
    "keeper",
    "base",
    "cuda",
    "lifetime",
    "wire",
    "send",
    "features",
    "tools",
    "face",
]
ROOMS = {
    "base": {
        "torchshm._native",
        "torchshm._compat",
        "torchshm._config",
        "torchshm._stats",
        "torchshm._fallback",
        "torchshm._memory",
        "torchshm._unloaded",
        "torchshm._version",
    },
    "wire": {"torchshm._reduction", "torchshm._strings"},
    "features": {
        "torchshm._containers",
        "torchshm._device",
        "torchshm._handles",
        "torchshm._dataloader",
        "torchshm._keys",
    },
    "face": {
        "torchshm.__main__",
        "torchshm.distributed",
        "torchshm.torchdata",
        "torchshm._share",
    },
}
KEEPER_FACTS = {
    "torchshm._keeper.paths",
    "torchshm._keeper.layout",
    "torchshm._keeper.protocol",
}


def room(module):
    """The room a module stands in."""
    for name, modules in ROOMS.items():
        if module in modules:
            return name
    parts = module.split(".")
    assert len(parts) >= 2 and parts[1].startswith("_"), module
    return parts[1][1:]  # torchshm._send.sender -> send


def test_every_module_stands_in_a_room_the_rule_knows():
    for module in all_modules():
        if module != "torchshm":
            assert room(module) in LAYERS, module


def test_the_wings_rule_holds():
    broken = []
    for module, imports in import_graph().items():
        mine = room(module)
        for target in imports:
            theirs = room(target)
            if theirs == "keeper" and mine != "keeper" and target not in KEEPER_FACTS:
                broken.append(f"{module} -> {target}: the daemon")
            elif mine == "keeper" and theirs != "keeper":
                broken.append(f"{module} -> {target}: the keeper is stdlib only")
            elif LAYERS.index(theirs) > LAYERS.index(mine):
                broken.append(f"{module} ({mine}) -> {target} ({theirs}): upward")
    assert not broken, broken


KEEPER = PACKAGE / "_keeper"
KEEPER_FILES = sorted(p.stem for p in KEEPER.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("stem", KEEPER_FILES)
def test_the_keeper_imports_only_the_standard_library(stem):
    # It runs as `python -I -S daemon.py`: its siblings are its own modules.
    import sys

    path = KEEPER / f"{stem}.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if name.startswith("torchshm."):
                assert name.startswith("torchshm._keeper"), (stem, name)
            else:
                assert top in sys.stdlib_module_names or top in KEEPER_FILES, (
                    stem,
                    name,
                )


# The wings' rule for csrc/, as for torchshm/: a file stands in the wing of
# its folder (the files on top of csrc/ in "top"), the wings in layers, and a
# file includes only its own wing's files and the wings' below:
#   base      the base headers, the policy Python hands over (config),
#             counters, threads, copies of array bytes
#   lifetime  segments, their table, holders, mappings, views, pool, slabs
#   items     the containers' item codec
#   send      the sender's plan and message, snapshots, the allocator,
#             tensors, and the rebuilds a message names
#   top       the module's bindings
# A header and its .cpp are one room; the rooms' includes form no cycle.
CXX_LAYERS = ["base", "lifetime", "items", "send", "top"]
CSRC = PACKAGE.parent / "csrc"
INCLUDE = re.compile(r'^#include "([^"]+)"', re.M)


def cxx_room(path):
    """lifetime/segment for csrc/lifetime/segment.h and .cpp."""
    return path.relative_to(CSRC).with_suffix("").as_posix()


def cxx_wing(room):
    return room.split("/")[0] if "/" in room else "top"


def include_graph():
    graph = {}
    for path in sorted(CSRC.rglob("*.[ch]*")):
        includes = graph.setdefault(cxx_room(path), set())
        for name in INCLUDE.findall(path.read_text()):
            assert (CSRC / name).is_file(), f"{path}: #include {name!r}, from csrc/"
            includes.add(cxx_room(CSRC / name))
        includes.discard(cxx_room(path))
    return graph


def test_every_csrc_file_stands_in_a_wing_the_rule_knows():
    for room in include_graph():
        assert cxx_wing(room) in CXX_LAYERS, room


def test_csrc_includes_follow_the_wings_rule():
    broken = [
        f"{room} -> {target}: upward"
        for room, includes in include_graph().items()
        for target in includes
        if CXX_LAYERS.index(cxx_wing(target)) > CXX_LAYERS.index(cxx_wing(room))
    ]
    assert not broken, broken


def test_the_include_graph_of_csrc_has_no_cycle():
    graph = include_graph()
    assert "lifetime/segment" in graph["send/plan"]  # the graph is read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))

"""The import graph of torchshm/ has no cycle, counting imports inside
functions too: a cycle that only a lazy import hides still ties two modules
into one (issue 23)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchshm"


def imported_modules(path):
    """Names of torchshm's own modules that `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "torchshm":  # from torchshm import _a, _b
                found.update(f"torchshm.{alias.name}" for alias in node.names)
            elif node.module.startswith("torchshm."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("torchshm."))
    return found


def import_graph():
    modules = {
        f"torchshm.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"
    }
    # The package itself re-exports everything; edges into it are not design.
    return {
        name: sorted(m for m in imported_modules(path) if m in modules and m != name)
        for name, path in modules.items()
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
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "torchshm":
                if any(alias.name == "_C" for alias in node.names):
                    found.add(path.stem)
            elif isinstance(node, ast.ImportFrom) and node.module == "torchshm._C":
                found.add(path.stem)
            elif isinstance(node, ast.Import):
                if any(a.name == "torchshm._C" for a in node.names):
                    found.add(path.stem)
    return found


def test_exactly_one_module_imports_the_native_extension():
    # Note [The seam] in torchshm/_native.py.
    assert native_importers() == {"_native"}


def test_the_native_stub_is_generated_from_the_native_module():
    import subprocess
    import sys

    script = PACKAGE.parent / "scripts" / "stubgen.py"
    result = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr

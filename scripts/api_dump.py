"""Writes torchshm's public names, signatures and docstrings as JSON for the
docs (Note [API from JSON] in docs/_ext/torchshm_docs.py).

    .venv/bin/python scripts/api_dump.py docs/_build/api.json

Public: `torchshm.__all__`, `torchshm.torchdata.__all__` and
`torchshm.distributed.__all__`, and the public members of their classes.
Signatures leave out annotations: the docstrings give each parameter's type.
"""

import inspect
import json
import sys
from pathlib import Path

import torchshm
from torchshm import distributed, torchdata

MODULES = (torchshm, torchdata, distributed)


def signature(obj):
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    if params and params[0].name == "self":
        params = params[1:]
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def member(name, value):
    """One public member of a class: a method or a property."""
    if isinstance(value, property):
        return {"name": name, "kind": "property", "doc": value.__doc__ or ""}
    function = getattr(value, "__func__", value)
    return {
        "name": name,
        "kind": "method",
        "signature": signature(function),
        "doc": inspect.getdoc(function) or "",
    }


def entry(name, obj):
    if inspect.ismodule(obj):
        return None  # documented as a module of its own
    if inspect.isclass(obj):
        kind = "exception" if issubclass(obj, BaseException) else "class"
        members = [
            member(m, v)
            for m, v in vars(obj).items()
            if not m.startswith("_") and (callable(v) or isinstance(v, property))
        ]
        init = signature(obj) if kind == "class" else ""
        return {
            "name": name,
            "kind": kind,
            "signature": init,
            "doc": inspect.cleandoc(obj.__doc__ or ""),
            "members": members,
        }
    return {
        "name": name,
        "kind": "function",
        "signature": signature(obj),
        "doc": inspect.cleandoc(obj.__doc__ or ""),
    }


def dump():
    modules = {}
    for module in MODULES:
        names = [entry(n, getattr(module, n)) for n in module.__all__]
        modules[module.__name__] = {
            "doc": inspect.cleandoc(module.__doc__ or ""),
            "names": [e for e in names if e is not None],
        }
    return {"version": torchshm.__version__, "modules": modules}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dump(), indent=1) + "\n")

"""Greedy delta debugging: the smallest program found, within a time limit,
that still shows the same kind of finding. First whole runs of steps go
(halves, quarters, ... single steps; grammar.validate drops what depended on
them), then parameters are made simpler one at a time (no threads, fork for
spawn where the finding allows, fewer and smaller arrays, os._exit).
Each try runs the program twice (seconds), so the limit decides."""

import time

from scripts.fuzz import grammar

SIMPLER_SIZES = (1 << 20, 65536, 32768, 4096)


def shrink(program, reproduces, seconds):
    """(smallest program, tries); `reproduces(program)` says whether a
    candidate still shows the finding."""
    deadline = time.monotonic() + seconds
    best, tries = program, 0

    def attempt(candidate):
        nonlocal best, tries
        candidate = grammar.validate(candidate)
        if candidate == best or time.monotonic() > deadline:
            return False
        tries += 1
        if reproduces(candidate):
            best = candidate
            return True
        return False

    chunk = max(1, len(best["steps"]) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        i = 0
        while i < len(best["steps"]) and time.monotonic() < deadline:
            steps = best["steps"][:i] + best["steps"][i + chunk :]
            if not attempt(dict(best, steps=steps)):
                i += chunk
        chunk //= 2
    progress = True
    while progress and time.monotonic() < deadline:
        # The simplifications of the best so far; after one is taken, anew
        # (validate may have dropped steps that depended on the old form).
        progress = any(attempt(rebase(best, change)) for change in simpler(best))
    return best, tries


def simpler(program):
    """One-change simplifications of the program (as index, step, or the
    whole program's fields)."""
    if program["exit"] != "os._exit":  # the quickest (draw.generate)
        yield ("program", {"exit": "os._exit"})
    for i, step in enumerate(program["steps"]):
        if step.get("thread"):
            yield (i, {"thread": False})
        if step["op"] == "start" and step["method"] != "fork":
            yield (i, {"method": "fork"})
        if step["op"] in ("pool", "loader"):
            if step["workers"] > 1:
                yield (i, {"workers": 1})
            if step["count"] > 2 and (step["op"] == "pool" or step["batch"] is None):
                yield (i, {"count": 2, "as": step["as"][:2]})
            for n in SIMPLER_SIZES:
                if n < step["nbytes"]:
                    yield (i, {"nbytes": n})
        if step["op"] == "atexit" and len(step["sizes"]) > 1:
            for n in range(1, len(step["sizes"])):
                yield (i, {"sizes": step["sizes"][:n], "as": step["as"][:n]})
        if step["op"] == "new":
            if len(step["shape"]) > 1:
                yield (
                    i,
                    {"shape": [step["shape"][0] * step["shape"][1]], "order": "C"},
                )
            if step["dtype"] != "u1":
                n = grammar.nbytes_of(step)
                yield (i, {"dtype": "u1", "shape": [n], "order": "C"})
            for n in SIMPLER_SIZES:
                if n < grammar.nbytes_of(step):
                    count = max(2, n // grammar.ITEMSIZE[step["dtype"]])
                    yield (i, {"shape": [count], "order": "C"})
            if step["make"] == "born_global":
                yield (i, {"make": "born"})
        if step["op"] == "write" and step["part"] != "all":
            yield (i, {"part": "all"})
        if step["op"] == "send" and len(step["items"]) > 1:
            for k in range(len(step["items"])):
                yield (i, {"items": [step["items"][k]], "as": [step["as"][k]]})


def rebase(program, change):
    where, fields = change
    if where == "program":
        return dict(program, **fields)
    steps = [dict(s) for s in program["steps"]]
    if where < len(steps):
        steps[where].update(fields)
        if fields.get("thread") is False:
            del steps[where]["thread"]
    return dict(program, steps=steps)

"""Drawing a program from a seed: steps that grammar.State allows, grouped in
episodes biased towards what has broken before (Note [Episodes])."""

import random

from scripts.fuzz.grammar import BORN, ITEMSIZE, NUMERIC, KiB, MiB, State

THRESHOLDS = (16384, 0, None)


class Builder:
    """Draws steps that State allows, biased towards what has broken before
    (Note [Episodes])."""

    def __init__(self, rng, threshold):
        self.rng = rng
        self.state = State(threshold)
        self.steps = []
        self.counter = 0

    def fresh(self, prefix):
        self.counter += 1
        return f"{prefix}{self.counter}"

    def add(self, step):
        if self.state.allows(step):
            self.state.apply(step)
            self.steps.append(step)
            return True
        return False

    def maybe_thread(self, step, p=0.2):
        if self.rng.random() < p:
            step["thread"] = True
        return step

    # -- processes
    def live(self, exclude=()):
        return [a for a, p in self.state.procs.items() if p.alive and a not in exclude]

    def start(self, parent="m", method=None):
        """A new child of `parent` (fork by default: a spawn or forkserver
        child imports torch, seconds); None at the cap."""
        if method is None:
            method = self.rng.choices(["fork", "spawn", "forkserver"], [20, 1, 1])[0]
        child = f"c{len(self.state.started) + 1}"
        ok = self.add({"op": "start", "at": parent, "child": child, "method": method})
        return child if ok else None

    def proc(self, exclude=(), new=0.3):
        """A live actor, or sometimes a new fork child of the main process."""
        choices = self.live(exclude)
        if not choices or self.rng.random() < new:
            child = self.start("m", "fork")
            if child:
                return child
        return self.rng.choice(choices) if choices else None

    def chan(self, pipe=None):
        if pipe is None:
            pipe = self.rng.random() < 0.5
        return ("p" if pipe else "q") + str(self.rng.randrange(2))

    # -- arrays
    def nbytes(self, born=False, kind=None):
        """Bytes: small (slab blocks when born: below 64 KiB), medium or
        large; born only from the threshold up."""
        r = self.rng
        kind = kind or r.choices(["small", "medium", "large"], [4, 4, 2])[0]
        if born and self.state.born_min > 48 * KiB and kind == "small":
            kind = "medium"
        if kind == "small":
            low = KiB if not born else max(KiB, self.state.born_min)
            return r.choice(
                [n for n in range(KiB, 49 * KiB, 4 * KiB) if n >= low] or [48 * KiB]
            )
        if kind == "medium":
            low = 64 * KiB if not born else max(64 * KiB, self.state.born_min)
            return r.choice(
                [n for n in (64 * KiB, 256 * KiB, 512 * KiB, MiB) if n >= low]
            )
        return r.choice([4 * MiB, 5 * MiB, 6 * MiB])

    def new(self, at, make=None, nbytes=None, dtype=None):
        r = self.rng
        make = (
            make
            or r.choices(["heap", "born", "born_global", "memmap"], [4, 4, 2, 1])[0]
        )
        dtype = dtype or r.choices(["f8", "f4", "u1", "i4", "rec"], [3, 2, 2, 1, 2])[0]
        nbytes = nbytes or self.nbytes(born=make in BORN)
        n = max(2, -(-nbytes // ITEMSIZE[dtype]))
        if r.random() < 0.3 and n >= 8:
            rows = r.choice([2, 4, 8])
            shape, order = [rows, -(-n // rows)], r.choice("CF")
        else:
            shape, order = [n], "C"
        name = self.fresh("a")
        step = {"op": "new", "at": at, "var": name, "make": make, "dtype": dtype}
        step.update(shape=shape, order=order, fill=self.fresh_fill())
        return name if self.add(self.maybe_thread(step, 0.1)) else None

    def fresh_fill(self):
        self.counter += 1
        return self.counter

    def view(self, at, src):
        hows = ["step2", "from1", "rev", "T", "field", "reshape"]
        self.rng.shuffle(hows)
        for how in hows:
            name = self.fresh("v")
            if self.add({"op": "view", "at": at, "var": name, "src": src, "how": how}):
                return name
        return None

    def write(self, at, name, part=None):
        part = part or self.rng.choices(["all", "head", "step3"], [4, 2, 1])[0]
        step = {
            "op": "write",
            "at": at,
            "var": name,
            "fill": self.fresh_fill(),
            "part": part,
        }
        return self.add(self.maybe_thread(step))

    def send(self, at, to, items, chan=None):
        names = [self.fresh("r") for _ in items]
        step = {"op": "send", "at": at, "to": to, "chan": chan or self.chan()}
        step.update(items=list(items), **{"as": names})
        return names if self.add(self.maybe_thread(step)) else None

    def names(self, at, roles=None):
        proc = self.state.procs[at]
        return [n for n, v in proc.names.items() if roles is None or v.role in roles]

    def sendable(self, at):
        return [n for n in self.names(at) if self.state.sendable(at, n)]


# Note [Episodes]
# A program is one to three episodes, each a few steps around one way that
# a later write or an ending could reach what was sent (the ways that broke
# before: the list in scripts/fuzz/__init__.py), with random steps
# between them. CI runs a minute of this: each way must come up in a good
# share of programs. An episode that State refuses a step just goes on.


def ep_relatives(b):
    """An array that a process and its fork child both hold, sent by one,
    then written by the other (and more)."""
    r = b.rng
    p = "m" if r.random() < 0.6 else b.proc()
    make = r.choices(["born", "born_global", "memmap", "heap"], [5, 2, 1, 1])[0]
    a = b.new(p, make=make)
    if a is None:
        return
    items = [a]
    if r.random() < 0.3:
        v = b.view(p, a)
        items = [v] if v and r.random() < 0.5 else items + ([v] if v else [])
    c = b.start(p, "fork")
    if c is None:
        return
    sender, writer = (p, c) if r.random() < 0.5 else (c, p)
    to = b.proc(exclude=(sender,), new=0.3)
    if to is None or not b.send(sender, to, items):
        return
    b.write(writer, a)
    if r.random() < 0.3:
        b.write(sender, a)
    if r.random() < 0.3:
        b.send(writer, b.proc(exclude=(writer,), new=0), [a])


def ep_reuse(b):
    """One buffer refilled and sent again (a DataLoader worker's, a Pool
    worker's, or the process's own), or freed and its memory made anew."""
    r = b.rng
    at = "m" if r.random() < 0.7 else b.proc()
    kind = r.choices(["loader", "pool", "own", "free"], [4, 3, 2, 1])[0]
    small = b.state.born_min <= 48 * KiB
    nbytes = b.nbytes(born=True, kind="small" if small and r.random() < 0.7 else None)
    count = r.randint(2, 5)
    if kind == "loader":
        batch = None if r.random() < 0.7 else r.randint(2, 3)
        collate = r.choices(["stack" if batch else "identity", "default"], [3, 1])[0]
        n = count if batch is None else -(-count // batch)
        step = {
            "op": "loader",
            "at": at,
            "workers": r.choice([1, 1, 2]),
            "nbytes": nbytes,
        }
        step.update(count=count, batch=batch, collate=collate, reuse=r.random() < 0.85)
        step.update(fill=b.fresh_fill(), **{"as": [b.fresh("r") for _ in range(n)]})
        b.add(step)
    elif kind == "pool":
        step = {
            "op": "pool",
            "at": at,
            "workers": r.choice([1, 1, 2]),
            "nbytes": nbytes,
        }
        step.update(count=count, reuse=r.random() < 0.85, init=r.random() < 0.8)
        step.update(fill=b.fresh_fill(), **{"as": [b.fresh("r") for _ in range(count)]})
        b.add(step)
    elif kind == "own":
        a = b.new(at, make=r.choice(BORN), nbytes=nbytes, dtype="f4")
        to = b.proc(exclude=(at,))
        for _ in range(count if a and to else 0):
            b.send(at, to, [a])
            b.write(at, a, part="all")
    else:  # its memory goes back to the pool; a new array may take it
        to = b.proc(exclude=(at,))
        for _ in range(count if to else 0):
            a = b.new(at, make=r.choice(BORN), nbytes=nbytes, dtype="f4")
            if a and b.send(at, to, [a]):
                b.add({"op": "del", "at": at, "var": a})
    received = b.names(at, ("recv",))
    if received and r.random() < 0.3:  # forwarded
        b.send(at, b.proc(exclude=(at,)), [r.choice(received)])


def ep_share(b):
    """A share()d array to one receiver, and the same array sent plainly to
    another; then writes by the holders."""
    r = b.rng
    p = "m" if r.random() < 0.6 else b.proc()
    make = r.choices(["born", "born_global", "heap"], [4, 1, 2])[0]
    kind = (
        r.choice(["small", "medium", "large"]) if b.state.threshold <= 16384 else None
    )
    a = b.new(
        p, make=make, nbytes=max(b.nbytes(born=True, kind=kind), b.state.threshold)
    )
    s = b.fresh("s")
    if a is None or not b.add({"op": "share", "at": p, "var": s, "src": a}):
        return
    r1 = b.proc(exclude=(p,), new=0.4)
    got = b.send(p, r1, [s]) if r1 else None
    r2 = b.proc(exclude=(p,), new=0.3)
    plain = b.send(p, r2, [a]) if r2 else None
    if got:  # the share's receiver writes: no plain receiver may see it
        b.write(r1, got[0])
    writes = [(p, s), (p, a)] + ([(r1, got[0])] if got else [])
    for at, name in r.sample(writes, r.randint(0, len(writes))):
        b.write(at, name)
    if got and r.random() < 0.3:
        b.send(r1, b.proc(exclude=(r1,), new=0), got)
    if plain and r.random() < 0.3:
        b.write(r2, plain[0])


def ep_rawfork(b):
    """A fork that skips the at-fork hooks, in a process that holds what it
    received (through shared memory: from the threshold up)."""
    r = b.rng
    p = "m" if r.random() < 0.6 else b.proc()
    sender = b.proc(exclude=(p,), new=0.5)
    if sender is None:
        return
    got = None
    if r.random() < 0.9:
        nbytes = max(b.nbytes(), b.state.threshold)
        a = b.new(sender, make=r.choice(["heap", "born"]), nbytes=nbytes)
        got = b.send(sender, p, [a]) if a else None
    action = r.choices(["drop", "send", "read", "none"], [6, 2, 1, 2])[0]
    step = {"op": "rawfork", "at": p, "action": action, "var": None, "chan": None}
    step.update(to=None, exit=r.choice(["os._exit", "sys.exit"]), **{"as": None})
    if action == "drop":
        step["var"] = got[0] if got else (b.names(p) or [None])[0]
    elif action in ("send", "read"):
        step["var"] = b.new(p, make="heap")
        if action == "send":
            step.update(chan=b.chan(pipe=True), to=b.proc(exclude=(p,)))
            step["as"] = [b.fresh("r")]
    b.add(step)


def ep_atexit(b):
    """A spawn child whose atexit handler sends."""
    r = b.rng
    c = b.start("m", "spawn")
    if c is None:
        return
    sizes = (
        [MiB] * 6 if r.random() < 0.6 else [b.nbytes() for _ in range(r.randint(1, 8))]
    )
    to = "m" if r.random() < 0.7 else b.proc(exclude=(c,))
    step = {"op": "atexit", "at": c, "to": to, "chan": "q" + str(r.randrange(2))}
    step.update(sizes=sizes, fill=b.fresh_fill(), how=r.choice(["return", "sys.exit"]))
    step["as"] = [b.fresh("r") for _ in sizes]
    b.add(step)


def ep_exit(b):
    """A child sends, then ends in one of the ways a process ends; its
    receivers go on with what they got."""
    r = b.rng
    c = b.start(b.proc(new=0) if r.random() < 0.3 else "m")
    to = b.proc(exclude=(c,), new=0.2) if c else None
    if to is None:
        return
    got = []
    for _ in range(r.randint(1, 2)):
        a = b.new(c)
        got += (b.send(c, to, [a]) or []) if a else []
    if r.random() < 0.5 and got:
        b.write(c, r.choice(b.names(c)))
    how = r.choices(["kill", "return", "sys.exit", "os._exit"], [3, 1, 1, 1])[0]
    b.add({"op": "end", "at": c, "how": how})
    for name in got:
        if r.random() < 0.5:
            b.write(to, name)
        if r.random() < 0.3:
            b.send(to, b.proc(exclude=(to,), new=0), [name])


def ep_resize(b):
    """An array resized after a send, and sent again."""
    r = b.rng
    at = b.proc(new=0.2)
    a = b.new(at, make=r.choice(["heap", "born"]))
    to = b.proc(exclude=(at,))
    if a and to and r.random() < 0.8:
        b.send(at, to, [a])
    if a:
        b.add(
            {
                "op": "resize",
                "at": at,
                "var": a,
                "n": r.choice([1, 100, 1 << 16, 1 << 20]),
            }
        )
        if to and r.random() < 0.6:
            b.send(at, to, [a])


def ep_tensor(b):
    """torch.from_numpy of an array or a view, written, sent, written."""
    r = b.rng
    at = b.proc(new=0.2)
    a = b.new(at, make=r.choice(["heap", "born"]), dtype=r.choice(NUMERIC))
    if a is None:
        return
    src = b.view(at, a) if r.random() < 0.3 else a
    t = b.fresh("t")
    if not src or not b.add({"op": "tensor", "at": at, "var": t, "src": src}):
        return
    b.write(at, r.choice([a, t]))
    to = b.proc(exclude=(at,))
    got = b.send(at, to, [t]) if to else None
    if got:
        b.write(r.choice([at, to]), t if r.random() < 0.5 else got[0])


def ep_random(b, steps=None):
    """Steps of any kind on what exists."""
    r = b.rng
    for _ in range(steps or r.randint(2, 6)):
        at = b.proc(new=0.15)
        if at is None:
            return
        names = b.names(at)
        kind = r.choices(
            ["new", "write", "send", "view", "del", "end", "resend"],
            [3, 4, 4, 2, 1, 1, 2],
        )[0]
        if kind == "new" or not names:
            b.new(at)
        elif kind == "write":
            b.write(at, r.choice(names))
        elif kind in ("send", "resend"):
            items = b.sendable(at)
            to = b.proc(exclude=(at,), new=0.1)
            if items and to:
                b.send(at, to, r.sample(items, min(len(items), r.randint(1, 2))))
        elif kind == "view":
            b.view(at, r.choice(names))
        elif kind == "del":
            b.add({"op": "del", "at": at, "var": r.choice(names)})
        elif kind == "end" and at != "m":
            b.add(
                {"op": "end", "at": at, "how": r.choice(["return", "kill", "sys.exit"])}
            )


EPISODES = {  # name: (function, weight)
    "relatives": (ep_relatives, 3),
    "reuse": (ep_reuse, 3),
    "share": (ep_share, 2.5),
    "rawfork": (ep_rawfork, 3),
    "atexit": (ep_atexit, 1.5),  # a spawn child: seconds
    "exit": (ep_exit, 1),
    "resize": (ep_resize, 0.7),
    "tensor": (ep_tensor, 0.7),
    "random": (ep_random, 1),
}


def generate(seed, without=()):
    """The program of `seed` (the same for the same seed and `without`: the
    episodes left out)."""
    rng = random.Random(seed)
    threshold = rng.choices(THRESHOLDS, [45, 25, 30])[0]
    b = Builder(rng, threshold)
    kinds = [k for k in EPISODES if k not in without]
    weights = [EPISODES[k][1] for k in kinds]
    for _ in range(rng.choices([1, 2, 3], [2, 4, 3])[0]):
        EPISODES[rng.choices(kinds, weights)[0]][0](b)
        if rng.random() < 0.5:
            ep_random(b, rng.randint(1, 2))
    # A process that imported torch takes 1.5-3 s here to exit through the
    # interpreter's teardown (os._exit: 0.1 s): most runs end by os._exit;
    # every way is still drawn, and actors end every way too.
    exit_how = rng.choices(["return", "sys.exit", "os._exit"], [2, 1, 7])[0]
    return {"seed": seed, "threshold": threshold, "steps": b.steps, "exit": exit_how}

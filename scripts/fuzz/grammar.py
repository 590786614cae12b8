"""Programs: what they are made of, and which of them mean one thing (draw.py
draws them from a seed).

A program is JSON data: {"seed", "threshold" (0, 16384 or null: the
default), "steps", "exit" (how the main process ends)}. Each step is a dict
with "op" and "at" (the actor that runs it: "m", the main process, or a child
"c1", "c2", ... that a "start" step made). The step kinds:

  new      at makes array `var`: make heap (NumPy's memory), born (inside
           torchshm.allocating()), born_global (between set_allocator(True)
           and (False)) or memmap; dtype u1/i4/f4/f8/rec (a structured
           dtype); shape, order, fill (the pattern's seed)
  view     var = src[::2], src[1:], src[::-1], src.T, src["f"], a reshape
  tensor   var = torch.from_numpy(src)
  write    fills all of var, its first element or every third row
  send     at sends items (names) to `to` over chan (q*: a Queue, p*: a
           Pipe); `to` names them `as`; share() results go as such
  share    var = torchshm.share(src)
  resize   src.resize(n, refcheck=False); the exception, if any, is recorded
  del      del var (and a gc.collect())
  start    at starts child actor `child` with method fork/spawn/forkserver
  end      actor at ends: return, sys.exit, os._exit, or SIGKILL ("kill")
  atexit   a spawn actor registers an atexit handler that puts arrays of
           `sizes` bytes into Queue chan and joins its feeder, then ends;
           `to` receives them
  pool     a fork Pool (initializer set_allocator(True) or none) maps
           `count` tasks that return fresh arrays or one reused buffer
  loader   a fork DataLoader over a Dataset that refills a fresh or one
           reused buffer per item; batch_size None or k; collate identity,
           np.stack or torch's default
  rawfork  at forks with libc's fork (no at-fork hooks); the child reads an
           array, drops one, sends one over a Pipe or nothing, then exits
           by os._exit or sys.exit

Note [Programs that mean one thing]
The reference run (TORCHSHM_DISABLE=1) defines what each step observes only
if the program leaves nothing to the implementation. State tracks, for every
name, the memory ("region") behind it, and allows only steps that keep every
later observation defined:
- private memory (NumPy's, a received array) is copied on write at a fork;
  shared memory (share() results, sent tensors) is one memory for every
  holder, writes seen by all; fork-shared memory (born arrays, memmaps):
  whether a process and a fork child see each other's writes is the
  implementation's (a memmap's are seen; born memory was shared, then
  copy-on-write since commit 6456ac3, and a sender's own mapping turns
  copy-on-write at a send). So once a holder writes fork-shared memory,
  what the others see of it is not defined: they may no longer send it.
- A message's items that share memory arrive as views of one buffer with
  torchshm and as separate copies without: the receiver must not write them.
- A sent tensor's storage moves to shared memory (torch's semantics), the
  NumPy array it came from stays where it was, or not: that array is retired.
- share() of an array born shared returns the same memory; the reference
  run emulates that (interpreter.op_share), so share() takes only an array
  that nothing else (a view, another process) holds.
- Views and tensors need a known shape and layout: none of a resized array.
"""

DEFAULT_THRESHOLD = 256 * 1024
MAX_CHILDREN = 4
ITEMSIZE = {"u1": 1, "i4": 4, "f4": 4, "f8": 8, "rec": 12}  # ops.DTYPES
NUMERIC = ("u1", "i4", "f4", "f8")
BORN = ("born", "born_global")
KiB, MiB = 1 << 10, 1 << 20


class Var:
    """A name in one process: what it is and the memory behind it."""

    def __init__(self, region, role, dtype, shape, **kw):
        self.region, self.role, self.dtype, self.shape = region, role, dtype, shape
        self.base = kw.get("base")  # the name of the array a view is of
        self.make = kw.get("make", "heap")
        self.contig = kw.get("contig", True)  # C-contiguous
        self.strides_ok = kw.get("strides_ok", True)  # for torch.from_numpy
        self.nowrite = kw.get("nowrite", False)
        self.retired = False

    def copy(self, region):
        twin = Var(region, self.role, self.dtype, self.shape)
        twin.__dict__.update({k: v for k, v in self.__dict__.items() if k != "region"})
        return twin

    @property
    def nbytes(self):
        n = ITEMSIZE[self.dtype]
        for d in self.shape or ():
            n *= d
        return n


class Region:
    def __init__(self, cls, holder):
        self.cls = cls  # "private", "forkshared" or "shared"
        self.holders = {holder}
        self.ambiguous = set()  # holders whose view a relative's write made so


class Proc:
    def __init__(self, parent, method):
        self.parent, self.method = parent, method
        self.alive, self.children, self.names = True, [], {}
        self.queue_put = False  # has a Queue feeder thread (rawfork's sys.exit)


class State:
    """The program so far (Note [Programs that mean one thing]): allows()
    says whether a step may come next, apply() takes it."""

    def __init__(self, threshold):
        self.threshold = DEFAULT_THRESHOLD if threshold is None else threshold
        self.born_min = max(1, self.threshold)
        self.procs = {"m": Proc(None, "main")}
        self.regions = {}
        self.started = set()

    # -- helpers
    def region(self, cls, holder):
        rid = len(self.regions)
        self.regions[rid] = Region(cls, holder)
        return rid

    def var(self, at, name):
        proc = self.procs.get(at)
        return proc.names.get(name) if proc and proc.alive else None

    def alive(self, at):
        return at in self.procs and self.procs[at].alive

    def sharers(self, at, rid):
        """Names of `at` on region rid."""
        return [n for n, v in self.procs[at].names.items() if v.region == rid]

    def sendable(self, at, name):
        v = self.var(at, name)
        if v is None or v.retired or at in self.regions[v.region].ambiguous:
            return False
        region = self.regions[v.region]
        # A tensor's first send moves its storage: not from under a relative.
        return not (
            v.role == "tensor" and region.cls == "forkshared" and region.holders != {at}
        )

    def own_alone(self, at, name):
        """An array `at` made that no view and no other process holds."""
        v = self.var(at, name)
        return (
            v is not None
            and v.role == "own"
            and not v.retired
            and v.shape is not None
            and self.regions[v.region].cls != "shared"
            and self.regions[v.region].holders == {at}
            and self.sharers(at, v.region) == [name]
        )

    # -- the rules
    def allows(self, s):
        op, at = s["op"], s["at"]
        if not self.alive(at):
            return False
        check = getattr(self, "allows_" + op)
        return check(s, self.procs[at])

    def allows_new(self, s, proc):
        return s["var"] not in proc.names

    def allows_view(self, s, proc):
        v, how = proc.names.get(s["src"]), s["how"]
        if v is None or s["var"] in proc.names or v.retired or v.shape is None:
            return False
        if (
            v.role not in ("own", "view", "recv")
            or self.regions[v.region].cls == "shared"
        ):
            return False
        if how == "field":
            return v.dtype == "rec"
        if how == "T":
            return len(v.shape) == 2
        if how == "reshape":
            return v.contig and (len(v.shape) == 2 or v.shape[0] % 2 == 0)
        return v.shape[0] >= 2

    def allows_tensor(self, s, proc):
        v = proc.names.get(s["src"])
        if v is None or s["var"] in proc.names or v.retired or v.shape is None:
            return False
        region = self.regions[v.region]
        return (
            v.role in ("own", "view")
            and v.dtype in NUMERIC
            and v.strides_ok
            and v.make != "memmap"
            and (region.cls == "private" or region.holders == {s["at"]})
        )

    def allows_write(self, s, proc):
        v = proc.names.get(s["var"])
        return v is not None and not v.retired and not v.nowrite

    def allows_send(self, s, proc):
        to, items = s["to"], s["items"]
        if to == s["at"] or not self.alive(to) or len(set(items)) != len(items):
            return False
        if any(n in self.procs[to].names for n in s["as"]):
            return False
        if not all(self.sendable(s["at"], n) for n in items):
            return False
        regions = [proc.names[n].region for n in items]
        tensors = [proc.names[n].role in ("tensor", "rtensor") for n in items]
        for i, rid in enumerate(regions):  # a tensor with nothing else of its memory
            if tensors[i] and regions.count(rid) > 1:
                return False
        return True

    def allows_share(self, s, proc):
        v = proc.names.get(s["src"])
        return (
            s["var"] not in proc.names
            and self.own_alone(s["at"], s["src"])
            and v.make in ("heap",) + BORN
        )

    def allows_resize(self, s, proc):
        v = proc.names.get(s["var"])
        return self.own_alone(s["at"], s["var"]) and v.make != "memmap"

    def allows_del(self, s, proc):
        return s["var"] in proc.names

    def allows_start(self, s, proc):
        return s["child"] not in self.started and len(self.started) < MAX_CHILDREN

    def allows_end(self, s, proc):
        return s["at"] != "m" and not any(self.alive(c) for c in proc.children)

    def allows_atexit(self, s, proc):
        return (
            self.allows_end(s, proc)
            and proc.method == "spawn"
            and s["to"] != s["at"]
            and self.alive(s["to"])
            and not any(n in self.procs[s["to"]].names for n in s["as"])
        )

    def allows_pool(self, s, proc):
        return not any(n in proc.names for n in s["as"])

    def allows_loader(self, s, proc):
        # A batch is np.stack's or torch's; an item is itself or torch's.
        collates = (
            ("identity", "default") if s["batch"] is None else ("stack", "default")
        )
        return s["collate"] in collates and self.allows_pool(s, proc)

    def allows_rawfork(self, s, proc):
        action, name = s["action"], s["var"]
        if s.get("thread"):
            return False
        # The child's sys.exit runs this process's exit functions: they would
        # wait for a Queue feeder thread that is not there, or (an actor's)
        # join children that are not its own, and exit 1.
        live_children = s["at"] != "m" and any(self.alive(c) for c in proc.children)
        if s["exit"] == "sys.exit" and (proc.queue_put or live_children):
            return False
        if action == "drop":
            return name in proc.names
        if action in ("read", "send"):
            v = proc.names.get(name)
            ok = v is not None and v.role == "own" and v.make == "heap"
            ok = ok and self.regions[v.region].cls == "private"
            if action == "send":
                return (
                    ok
                    and self.sendable(s["at"], name)
                    and s["to"] != s["at"]
                    and self.alive(s["to"])
                    and s["as"][0] not in self.procs[s["to"]].names
                )
            return ok
        return True

    # -- taking a step
    def apply(self, s):
        getattr(self, "apply_" + s["op"])(s, self.procs[s["at"]])

    def apply_new(self, s, proc):
        forkshared = s["make"] == "memmap" or (
            s["make"] in BORN and nbytes_of(s) >= self.born_min
        )
        rid = self.region("forkshared" if forkshared else "private", s["at"])
        contig = s["order"] == "C" or len(s["shape"]) == 1
        proc.names[s["var"]] = Var(
            rid, "own", s["dtype"], list(s["shape"]), make=s["make"], contig=contig
        )

    def apply_view(self, s, proc):
        v, how = proc.names[s["src"]], s["how"]
        shape = list(v.shape)
        if how == "step2":
            shape[0] = (shape[0] + 1) // 2
        elif how == "from1":
            shape[0] -= 1
        elif how == "T":
            shape.reverse()
        elif how == "reshape":
            shape = [2, shape[0] // 2] if len(shape) == 1 else [shape[0] * shape[1]]
        w = v.copy(v.region)
        w.role, w.base, w.shape = "view", v.base or s["src"], shape
        w.contig = v.contig and how in ("from1", "reshape")
        w.strides_ok = v.strides_ok and how not in ("rev", "field")
        if how == "field":
            w.dtype = "f8"
        proc.names[s["var"]] = w

    def apply_tensor(self, s, proc):
        v = proc.names[s["src"]]
        w = v.copy(v.region)
        w.role, w.base = "tensor", v.base or s["src"]
        proc.names[s["var"]] = w

    def apply_write(self, s, proc):
        region = self.regions[proc.names[s["var"]].region]
        if region.cls == "forkshared":
            region.ambiguous |= region.holders - {s["at"]}

    def apply_send(self, s, proc):
        at, to = s["at"], self.procs[s["to"]]
        if s["chan"].startswith("q"):
            proc.queue_put = True
        regions = [proc.names[n].region for n in s["items"]]
        for name, new in zip(s["items"], s["as"]):
            v = proc.names[name]
            if v.role == "tensor" and self.regions[v.region].cls != "shared":
                # Its storage moves to shared memory; the arrays it came from
                # stay behind, retired.
                for other in self.sharers(at, v.region):
                    proc.names[other].retired = True
                v.region, v.retired = self.region("shared", at), False
            region = self.regions[v.region]
            if region.cls == "shared" and v.role in (
                "tensor",
                "rtensor",
                "shared",
                "rshared",
            ):
                w = v.copy(v.region)
                w.role = "rtensor" if v.role in ("tensor", "rtensor") else "rshared"
                region.holders.add(s["to"])
            else:
                w = v.copy(self.region("private", s["to"]))
                w.role, w.base, w.make = "recv", None, "heap"
                w.nowrite = v.nowrite or regions.count(v.region) > 1
            to.names[new] = w

    def apply_share(self, s, proc):
        v = proc.names[s["src"]]
        region = self.regions[v.region]
        if v.nbytes < self.threshold:  # an ordinary copy
            w = v.copy(self.region("private", s["at"]))
            w.make = "heap"
        elif region.cls == "forkshared":  # born: the same memory
            region.cls = "shared"
            w = v.copy(v.region)
            w.role = "shared"
        else:
            w = v.copy(self.region("shared", s["at"]))
            w.role = "shared"
        proc.names[s["var"]] = w

    def apply_resize(self, s, proc):
        v = proc.names[s["var"]]
        v.shape, v.contig = None, True  # resized, or not: the runs will say

    def apply_del(self, s, proc):
        v = proc.names.pop(s["var"])
        if not self.sharers(s["at"], v.region):
            self.regions[v.region].holders.discard(s["at"])

    def apply_start(self, s, proc):
        child = Proc(s["at"], s["method"])
        self.procs[s["child"]] = child
        self.started.add(s["child"])
        proc.children.append(s["child"])
        if s["method"] != "fork":
            return
        clones = {}
        for name, v in proc.names.items():
            region = self.regions[v.region]
            if region.cls == "private":
                if v.region not in clones:
                    clones[v.region] = self.region("private", s["child"])
                child.names[name] = v.copy(clones[v.region])
            else:
                region.holders.add(s["child"])
                if s["at"] in region.ambiguous:
                    region.ambiguous.add(s["child"])
                child.names[name] = v.copy(v.region)

    def apply_end(self, s, proc):
        proc.alive = False
        for v in proc.names.values():
            self.regions[v.region].holders.discard(s["at"])
        proc.names = {}

    def apply_atexit(self, s, proc):
        self.apply_end(s, proc)
        for name, size in zip(s["as"], s["sizes"]):
            self.procs[s["to"]].names[name] = Var(
                self.region("private", s["to"]), "recv", "u1", [size]
            )

    def apply_pool(self, s, proc):
        for name in s["as"]:
            rid = self.region("private", s["at"])
            proc.names[name] = Var(rid, "recv", "f4", [s["nbytes"] // 4])

    def apply_loader(self, s, proc):
        n, batch = s["nbytes"] // 4, s["batch"]
        for j, name in enumerate(s["as"]):
            if batch is None:
                shape = [n]
            else:
                shape = [min(batch, s["count"] - j * batch), n]
            if s["collate"] == "default":  # a tensor in shared memory
                proc.names[name] = Var(
                    self.region("shared", s["at"]), "rtensor", "f4", shape
                )
            else:
                proc.names[name] = Var(
                    self.region("private", s["at"]), "recv", "f4", shape
                )

    def apply_rawfork(self, s, proc):
        if s["action"] == "send":
            v = proc.names[s["var"]]
            w = v.copy(self.region("private", s["to"]))
            w.role = "recv"
            self.procs[s["to"]].names[s["as"][0]] = w


def nbytes_of(step):
    n = ITEMSIZE[step["dtype"]]
    for d in step["shape"]:
        n *= d
    return n


def validate(program):
    """The program less every step that its earlier steps do not allow (the
    shrinker drops steps; what depended on them goes too)."""
    state = State(program["threshold"])
    kept = []
    for step in program["steps"]:
        if state.allows(step):
            state.apply(step)
            kept.append(step)
    return dict(program, steps=kept)


# --------------------------------------------------------------- reading


def size(n):
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def describe(step):
    """One line a person reads."""
    s, op = step, step["op"]
    if op == "new":
        shape = "x".join(map(str, s["shape"])) + (
            ", F order" if s["order"] == "F" else ""
        )
        text = f"{s['var']} = {s['make']} {s['dtype']}[{shape}] ({size(nbytes_of(s))})"
    elif op == "view":
        text = f"{s['var']} = view {s['how']} of {s['src']}"
    elif op == "tensor":
        text = f"{s['var']} = torch.from_numpy({s['src']})"
    elif op == "write":
        text = f"write {s['var']} ({s['part']})"
    elif op == "send":
        items, names = ", ".join(s["items"]), ", ".join(s["as"])
        text = f"send {items} to {s['to']} via {s['chan']} as {names}"
    elif op == "share":
        text = f"{s['var']} = torchshm.share({s['src']})"
    elif op == "resize":
        text = f"{s['var']}.resize({s['n']}, refcheck=False)"
    elif op == "del":
        text = f"del {s['var']}"
    elif op == "start":
        text = f"start {s['child']} ({s['method']})"
    elif op == "end":
        text = f"end by {s['how']}"
    elif op == "atexit":
        sizes = ", ".join(size(n) for n in s["sizes"])
        text = (
            f"atexit: put [{sizes}] into {s['chan']} for {s['to']}, join the"
            f" feeder; end by {s['how']}"
        )
    elif op in ("pool", "loader"):
        if op == "loader":
            extra = f", batch {s['batch']}, collate {s['collate']}"
        else:
            extra = ", initializer set_allocator(True)" if s["init"] else ""
        reuse = "one reused buffer" if s["reuse"] else "fresh arrays"
        text = (
            f"{op}: {s['count']} x {size(s['nbytes'])} ({reuse}), {s['workers']}"
            f" worker(s){extra} -> {', '.join(s['as'])}"
        )
    else:  # rawfork
        what = s["action"] + (f" {s['var']}" if s["var"] else "")
        if s["action"] == "send":
            what += f" to {s['to']} via {s['chan']} as {s['as'][0]}"
        text = f"libc fork: the child does {what}, then {s['exit']}"
    return f"{s['at']}: {text}" + (" (in a thread)" if s.get("thread") else "")


def describe_program(program):
    threshold = program["threshold"]
    threshold = "default" if threshold is None else threshold
    head = f"threshold {threshold}, main ends by {program['exit']}"
    return [head] + [f"{i:2d} {describe(s)}" for i, s in enumerate(program["steps"])]

"""Shared fixtures: start methods, bounded child runs, the leak checker (on
every multiprocess test by itself), the reducer registry restored after each
test, and counter deltas."""

import gc
import json
import multiprocessing as mp
import os
import select
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.reduction import ForkingPickler

# Every array of at least one byte is shared, so small test arrays exercise the
# shared path; set before torchshm is imported so that children inherit it.
os.environ.setdefault("TORCHSHM_THRESHOLD", "1")
# Under pytest-xdist (`make test` runs three workers) each worker is a session
# of its own, as a separately launched program is: the leak check counts
# this session's segments, which the other worker's tests must not move. Only
# the worker itself leaves the inherited session: its children that import
# this module (tests/children.py) must stay in the worker's.
if os.environ.get("PYTEST_XDIST_WORKER") and "TORCHSHM_TEST_WORKER" not in os.environ:
    os.environ.pop("TORCHSHM_SESSION", None)
    os.environ["TORCHSHM_TEST_WORKER"] = str(os.getpid())

import pytest  # noqa: E402

import torchshm  # noqa: E402
from torchshm._lifetime import session as _session  # noqa: E402
from torchshm._send import registry as _registry  # noqa: E402
from torchshm._send import tensors as _tensors  # noqa: E402
from torchshm._tools import doctor as _doctor  # noqa: E402

START_METHODS = ("fork", "spawn", "forkserver")
TIMEOUT = 60
# The dead-process reaper frees a segment within ~1-2 s, and a never-received
# message's ticket dies ~2-3 s after its pipe closes (Note [Segment lifetime]
# in csrc/lifetime/segment.h): the leak check waits this long for both.
LEAK_GRACE = 10

# A test that asks for one of these fixtures starts processes, wherever it is.
MULTIPROCESS_FIXTURES = {"ctx", "child", "method"}


# Note [What each lane runs]
# The pip lane (`make test`, the README's) runs every test. The others run
# what their stack can change (`--lane`, given by the Makefile and
# scripts/debian_lane.sh), so that .ci/run's eight lanes fit in 70 minutes
# on a busy 2-core machine:
# - any_stack: what no version of torch, NumPy, pandas or Python changes
#   (the docs, notebooks, packaging and tooling, each run on the pip lane's
#   stack): the pip lane only.
# - torch_os: what depends on torch and the OS, not on Python's, NumPy's or
#   pandas' version (torch's tensors, limits, handles, the GPU path): not the
#   newest lane, whose torch is the pip lane's.
# - python_os: the session keeper and what goes wrong around it (its death,
#   stops and fd limits, faults, planted files): torchshm's own processes,
#   fds and files, which change with Python (its fork, exit and threads) and
#   the kernel, every lane's, and meet torch and NumPy where every other
#   test does. The pip lane (Python 3.11) and Debian 13 (3.13) only: Debian
#   12's Python is the pip lane's 3.11, the newest lane's Debian 13's 3.13.
# - The Debian and newest lanes start children by fork and forkserver, not
#   spawn: forkserver's children unpickle their arguments in a fresh
#   interpreter as spawn's do (the late registration under test), without
#   each importing torch again (a third of those lanes' time).
# - spawn_one_case: a test whose other parameters are about what travels (a
#   dtype, a size, which kind of array or column) runs its spawn children
#   for the first of those cases only, fork and forkserver for every case. A
#   spawn child imports torch itself (2-3 s each: the pip lane spent 650 of
#   its 2,300 worker-seconds in spawn tests), and what spawn alone does (a
#   fresh interpreter that imports torch only when a message needs it, an
#   exit through sys.exit rather than os._exit) is the same for every dtype.
#   A test whose parameters are about how workers start, register or exit
#   (the remedies, the late import, the exit cases) keeps every case.
FORK_AND_FORKSERVER = ("fork", "forkserver")
LANES = {
    "pip": {"markers": (), "start_methods": START_METHODS},
    "debian12": {
        "markers": ("any_stack", "python_os"),
        "start_methods": FORK_AND_FORKSERVER,
    },
    "debian13": {"markers": ("any_stack",), "start_methods": FORK_AND_FORKSERVER},
    "newest": {
        "markers": ("any_stack", "torch_os", "python_os"),
        "start_methods": FORK_AND_FORKSERVER,
    },
}


def pytest_addoption(parser):
    parser.addoption(
        "--lane",
        choices=sorted(LANES),
        default="pip",
        help="deselect what this lane leaves to the pip lane (Note [What each"
        " lane runs] in tests/conftest.py)",
    )


def _start_methods(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    return [params.get(k) for k in MULTIPROCESS_FIXTURES if k in params]


def _spawn_cases_beyond_the_first(items):
    """The spawn items of each spawn_one_case test but its first (Note [What
    each lane runs])."""
    seen, beyond = set(), []
    for item in items:
        if item.get_closest_marker("spawn_one_case") and "spawn" in _start_methods(
            item
        ):
            test = (item.parent.nodeid, item.originalname)
            if test in seen:
                beyond.append(item)
            seen.add(test)
    return beyond


def _left_to_another_lane(item, lane):
    if any(item.get_closest_marker(m) for m in lane["markers"]):
        return True
    methods = _start_methods(item)
    return any(m in START_METHODS and m not in lane["start_methods"] for m in methods)


def add_markers(config):
    config.addinivalue_line(
        "markers",
        "any_stack: the same on every stack; the pip lane only (Note [What each"
        " lane runs] in tests/conftest.py)",
    )
    config.addinivalue_line(
        "markers",
        "torch_os: depends on torch and the OS only; not the newest lane (Note"
        " [What each lane runs] in tests/conftest.py)",
    )
    config.addinivalue_line(
        "markers",
        "python_os: depends on Python and the OS only; the pip and Debian 13"
        " lanes (Note [What each lane runs] in tests/conftest.py)",
    )
    config.addinivalue_line(
        "markers",
        "spawn_one_case: spawn runs the first of the other parameters' cases"
        " only (Note [What each lane runs] in tests/conftest.py)",
    )
    config.addinivalue_line(
        "markers",
        "multiprocess: the test starts processes; the no_leaks check applies",
    )
    config.addinivalue_line(
        "markers",
        "keeps_segments(reason): a multiprocess test that leaves shared memory"
        " alive on purpose (e.g. a module-level shared object); no leak check",
    )


SDIST_TEST = (
    "test_sdist.py::test_sdist_has_every_source_file_and_installs_into_a_fresh_venv"
)


def _sdist_module():
    from tests import test_sdist

    return test_sdist


def pytest_configure(config):
    add_markers(config)
    if getattr(config.option, "numprocesses", None) and not hasattr(
        config, "workerinput"
    ):
        # The xdist controller: the workers it starts find the build here.
        _sdist_module().prepare_shared_build()


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(session, config, items):
    """First what this lane leaves to another (Note [What each lane runs]).
    The sdist test compiles the extension: its build starts now, in the
    background, and the test runs last, when the build is likely done. Under
    xdist the controller starts it, once, when a worker has collected it."""
    lane = LANES[config.getoption("--lane")]
    left = {id(item): item for item in items if _left_to_another_lane(item, lane)}
    left.update((id(item), item) for item in _spawn_cases_beyond_the_first(items))
    if left:
        config.hook.pytest_deselected(items=list(left.values()))
        items[:] = [item for item in items if id(item) not in left]
    sdist = [item for item in items if item.nodeid.endswith(SDIST_TEST)]
    if sdist and not config.option.collectonly:
        items[:] = [item for item in items if item not in sdist] + sdist
        if not hasattr(config, "workerinput"):
            sdist[0].module.start_build()


def pytest_collection_finish(session):
    """Everything imported and collected so far is frozen out of the garbage
    collector: with torch, NumPy and pandas loaded a full gc.collect() walks
    ~230,000 objects (90-130 ms here), and the leak check collects twice per
    multiprocess test, the tests themselves more (13% of the suite's time).
    After the freeze a collection walks only what the tests made since."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    if any(nodeid.endswith(SDIST_TEST) for nodeid in ids):
        _sdist_module().start_build()


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):
        for name in ("test_sdist", "tests.test_sdist"):  # as collected, or not
            if name in sys.modules:
                sys.modules[name].discard_build()


@pytest.fixture(scope="session", autouse=True)
def warm_start_methods():
    # The forkserver, the resource tracker and torch's shm manager (its
    # file_system strategy) keep fds open for the whole run; start them before
    # any test counts fds.
    # The forkserver imports torch once, as a server started from a program
    # that imported it would: its children skip the 1.5 s import, which
    # would otherwise make each forkserver test cost a spawn. torchshm is
    # not preloaded: its late registration in workers is under test.
    mp.set_forkserver_preload(["torch", "numpy"])
    for method in START_METHODS:
        ctx = mp.get_context(method)
        p = ctx.Process(target=os.getpid)
        p.start()
        p.join(TIMEOUT)
        assert p.exitcode == 0
    import torch
    import torch.multiprocessing

    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        torch.zeros(1).share_memory_()
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)


@pytest.fixture(params=START_METHODS)
def ctx(request):
    return mp.get_context(request.param)


def keeper_segments(session=None):
    """{name: the keeper's report} of the segments a session's keeper holds
    (default: this process's session); empty once the keeper is gone."""
    report = _session.status(session)
    if report is None:
        return {}
    return {f"torchshm:{report['session']}:{s['uid']}": s for s in report["segments"]}


def session_segments(session=None):
    """Names of the segments of a session that can still be loaded."""
    return set(keeper_segments(session))


def memfd_holders(session, indices):
    """(pid, index) for every process that still has an fd or a mapping of
    segment `index` of `session` (its memfd, torchshm-segment:<session>:<index>,
    csrc/lifetime/segment.cpp). A memfd's memory is freed when the last of these goes,
    so an empty answer means the kernel has its pages back: a stronger check
    than Shmem, which every other process on a shared machine moves too."""
    wanted = {f"{_doctor.SEGMENT_MAPPING[1:]}{session}:{i}": i for i in indices}
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        # Each fd on its own: one closed meanwhile (the keeper opens and
        # closes fds all the time) must not hide the process's others.
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            name = target[1:].split(" ", 1)[0]  # "/memfd:<name> (deleted)"
            if name in wanted:
                found.add((int(pid), wanted[name]))
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = maps.readlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            name = fields[5][1:].split(" ", 1)[0] if len(fields) == 6 else ""
            if name in wanted:
                found.add((int(pid), wanted[name]))
    return found


def open_fds():
    return set(os.listdir("/proc/self/fd"))


def segment_mappings():
    """Lines of /proc/self/maps that map a torchshm segment."""
    with open("/proc/self/maps") as f:
        return [line for line in f if _doctor.SEGMENT_MAPPING in line]


def session_bytes(names=None):
    """Memory that this session's segments take (allocated pages, not their
    nominal sizes), as their keeper sees them."""
    segments = keeper_segments()
    return sum(s["bytes"] for n, s in segments.items() if names is None or n in names)


def _leak_snapshot():
    # Reaps children that already exited: multiprocessing keeps each one's
    # sentinel fd open until something asks (a DataLoader that gave up
    # joining a slow worker never does). A child still running stays counted.
    mp.active_children()
    gc.collect()
    torchshm.trim()
    segments = session_segments()
    return {
        "segments": segments,
        "fds": len(open_fds()),
        "mappings": len(segment_mappings()),
        "bytes": session_bytes(segments),
    }


def _leaks(before):
    now = _leak_snapshot()
    leaks = {}
    extra = now["segments"] - before["segments"]
    if extra:
        leaks["segments left behind"] = sorted(extra)
    for key, what in (
        ("fds", "fds left open"),
        ("mappings", "segment mappings left in /proc/self/maps"),
        ("bytes", "bytes of /dev/shm more in this session's segments"),
    ):
        if now[key] > before[key]:
            leaks[what] = now[key] - before[key]
    return leaks


@pytest.fixture
def no_leaks():
    """Fails a test that leaves a segment, an fd, a mapping of a segment or
    /dev/shm bytes of this session behind once its processes are gone. Dead
    processes' segments and unreceived tickets take a few seconds to die (see
    LEAK_GRACE); the pool and the mapping cache keep idle memory on purpose,
    and trim() hands it back before each count."""
    before = _leak_snapshot()
    yield
    deadline = time.monotonic() + LEAK_GRACE
    while (leaks := _leaks(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not leaks, f"after {LEAK_GRACE} s: {leaks}"


def is_multiprocess(item):
    """Whether a test starts processes: it asks for ctx, child or method, or
    is marked multiprocess (itself, or its module by `pytestmark`: a module
    whose every test starts processes says so at its top)."""
    return bool(
        MULTIPROCESS_FIXTURES & set(item.fixturenames)
        or item.get_closest_marker("multiprocess")
    )


@pytest.fixture(autouse=True)
def _leak_check_for_multiprocess_tests(request):
    """no_leaks for every multiprocess test, unless it opts out with
    @pytest.mark.keeps_segments(reason=...). A test that names no_leaks itself
    keeps its own fixture order (a fixture whose files pytest holds until the
    test is dropped must come before it)."""
    keeps = request.node.get_closest_marker("keeps_segments")
    if keeps is not None:
        if not (keeps.kwargs.get("reason") or keeps.args):
            pytest.fail("keeps_segments needs a reason")
    elif "no_leaks" not in request.fixturenames and is_multiprocess(request.node):
        request.getfixturevalue("no_leaks")
    yield


@pytest.fixture(autouse=True)
def reducer_registry():
    """Restores ForkingPickler's reducers for ndarrays, torchshm's
    registration state and the threshold after each test, so that one calling
    register(), unregister(), disabled() or set_threshold() cannot change the
    next. Reducers that an import registered during the test (torch's, the
    first time torch.multiprocessing is imported) stay."""
    table = ForkingPickler._extra_reducers
    saved, previous = dict(table), _registry._previous
    threshold = torchshm.get_threshold()
    tensors, switch = _tensors.enabled(), os.environ.get(_tensors.SWITCH)
    yield
    with _registry._lock:
        for t in list(table):
            if t not in saved and t in _registry.REDUCERS:
                del table[t]
        table.update(saved)
        _registry._previous = previous
        if previous is None:
            _tensors.uninstall()
        else:
            _tensors.install()
    torchshm.set_threshold(threshold)
    _tensors._enabled = tensors
    if switch is None:
        os.environ.pop(_tensors.SWITCH, None)
    else:
        os.environ[_tensors.SWITCH] = switch


def stats_delta(before, after=None):
    """What torchshm.stats() gained since `before` (a stats() snapshot taken
    just before the action under test), fallbacks included."""
    after = torchshm.stats() if after is None else after
    delta = {k: after[k] - before[k] for k in after if k != "fallbacks"}
    delta["fallbacks"] = {
        k: n - before["fallbacks"].get(k, 0)
        for k, n in after["fallbacks"].items()
        if n != before["fallbacks"].get(k, 0)
    }
    return delta


def bounded(fn, *args, timeout=TIMEOUT):
    """Calls a wait that takes no timeout (Pool.join, an executor's shutdown)
    in a thread, and fails the test if it is not done within `timeout`."""
    done = threading.Thread(target=fn, args=args, daemon=True)
    done.start()
    done.join(timeout)
    assert not done.is_alive(), f"{fn} did not return within {timeout} s"


def true_in_forked_child(check, timeout=TIMEOUT):
    """Whether `check()` returns true in a child made by a bare os.fork (no
    multiprocessing bootstrap); the child must exit within `timeout`."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(w, b"1" if check() else b"0")
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert select.select([r], [], [], timeout)[0], "the child did not answer"
        answer = os.read(r, 1)
    finally:
        os.close(r)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
            time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0
    return answer == b"1"


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(source, *args, env=None, timeout=2 * TIMEOUT):
    """Runs `source` in a fresh interpreter (its own imports), from the
    checkout's root, with `args` as sys.argv[1:] and `env` (default: this
    process's environment); the finished process."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=os.environ if env is None else env,
    )


def run_script(tmp_path, source, *args):
    """Runs `source` as a user's main script (its own process, so its own
    imports); returns what it printed as JSON."""
    script = tmp_path / "train.py"
    script.write_text(source)
    run = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=2 * TIMEOUT,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


class Child:
    """A child process with an inbox and an outbox; every wait is bounded."""

    def __init__(self, ctx, target, *args):
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=target, args=(self.inbox, self.outbox) + args, daemon=True
        )
        self.process_name = f"{target.__module__}.{target.__name__}"
        self.process.start()
        self.exitcode = None

    def send(self, obj):
        self.inbox.put(obj)

    def receive(self):
        return self.outbox.get(timeout=TIMEOUT)

    def close(self):
        self.process.join(TIMEOUT)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(TIMEOUT)
        exitcode = self.exitcode = self.process.exitcode
        for q in (self.inbox, self.outbox):
            q.close()
            q.join_thread()
        # A queue closes its write end only when freed.
        self.inbox = self.outbox = None
        self.process.close()
        return exitcode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture
def child():
    children = []

    def start(ctx, target, *args):
        c = Child(ctx, target, *args)
        children.append(c)
        return c

    yield start
    for c in children:
        if c.inbox is not None:
            c.close()
    failed = {c.process_name: c.exitcode for c in children if c.exitcode != 0}
    assert not failed, f"children exited with {failed}"


def script(name):
    """scripts/NAME.py as a module (scripts/ is no package): tests use what the
    docs tooling uses."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts")
    spec = importlib.util.spec_from_file_location(name, f"{path}/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


__all__ = [
    "torchshm",
    "Child",
    "bounded",
    "open_fds",
    "segment_mappings",
    "session_bytes",
    "session_segments",
    "stats_delta",
]

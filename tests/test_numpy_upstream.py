"""NumPy's own pickling tests, run with ForkingPickler swapped in for pickle.

Every upstream test that pickles (calls pickle.dumps/dump, ndarray.dumps/dump,
or a helper of its class or module that does) is collected here as a subclass
of its upstream class, with NumPy's other tests hidden. While one runs,
pickle.dumps and pickle.dump are ForkingPickler with torchshm registered (the
threshold at 1 byte), so the arrays those tests pickle travel through shared
memory, and each test must have gone through the swap at least once. Tests
where torchshm deliberately differs from NumPy's pickle are strict xfails
(DELIBERATE_DIFFERENCES; docs/guide/sending.md, "Differences from NumPy's own
pickle").

Below them: user-registered and legacy dtypes through ForkingPickler and a
spawned child (issue 9, item 5).
"""

import functools
import importlib
import inspect
import io
import multiprocessing as mp
import pickle
import types
import warnings
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import pytest

import torchshm
from tests import children
from tests.cases import value_bytes

NUMPY_DIR = Path(np.__file__).parent
# numpy 2.x moved numpy/core to numpy/_core (numpy.core stays as a shim there).
CORE = "_core" if (NUMPY_DIR / "_core" / "tests").is_dir() else "core"

# The upstream modules whose tests pickle arrays, dtypes or objects holding them.
UPSTREAM_MODULES = [
    f"numpy.{CORE}.tests.test_multiarray",
    f"numpy.{CORE}.tests.test_dtype",
    f"numpy.{CORE}.tests.test_records",
    f"numpy.{CORE}.tests.test_datetime",
    f"numpy.{CORE}.tests.test_regression",
    f"numpy.{CORE}.tests.test_ufunc",
    f"numpy.{CORE}.tests.test__exceptions",
    "numpy.ma.tests.test_core",
    "numpy.ma.tests.test_old_ma",
    "numpy.ma.tests.test_mrecords",
    "numpy.matrixlib.tests.test_masked_matrix",
    "numpy.random.tests.test_direct",
    "numpy.random.tests.test_randomstate",
    "numpy.random.tests.test_smoke",
    "numpy.polynomial.tests.test_polynomial",
]


def _is_array(protocol, val):
    return isinstance(val, np.ndarray)


# Where torchshm differs from NumPy's own pickle on purpose (docs/guide/sending.md,
# "Differences from NumPy's own pickle"): "module:Class.test" -> (reason, the
# parameters it applies to, or None for all). These must fail, with an AssertionError.
DELIBERATE_DIFFERENCES = {
    "multiarray:TestFlags.test_writeable_pickle": (
        "the arrays' base is the int8 torch tensor over their segment, not bytes",
        None,
    ),
    "multiarray:TestZeroSizeFlexible.test_pickle_with_buffercallback": (
        "snapshot at send: no protocol-5 out-of-band buffer aliasing the sender",
        None,
    ),
    "multiarray:TestPickling.test_f_contiguous_array": (
        "snapshot at send: no protocol-5 out-of-band buffers (buffer_callback "
        "is never called)",
        None,
    ),
    # NumPy 2.3's twin of the test above, for transposed arrays.
    "multiarray:TestPickling.test_transposed_contiguous_array": (
        "snapshot at send: no protocol-5 out-of-band buffers (buffer_callback "
        "is never called)",
        None,
    ),
    "multiarray:TestPickling.test_datetime64_byteorder": (
        "zero copy: a non-native datetime64 array keeps its byte order (NumPy "
        "byte-swaps it to native); the values are equal",
        None,
    ),
    "regression:TestRegression.test_pickle_module": (
        "the pickle of an array names torchshm's rebuild, not numpy.core.multiarray",
        _is_array,
    ),
}

# Upstream tests that pickle something other than arrays and depend on how
# they are imported, not on the pickler: left out, with the reason.
NOT_APPLICABLE = {
    "ufunc:TestUfunc.test_pickle_name_is_qualname": (
        "pickles a ufunc by qualname through a class attribute it sets on its own"
        " module; with numpy 2.x's suite imported by this harness the lookup"
        " finds another import of that module (no array is involved)"
    ),
}

_PICKLING_NAMES = frozenset({"dumps", "dump"})


def _names_used(function):
    """The global and attribute names a function's code (nested code too) uses."""
    code = getattr(function, "__code__", None)
    names, stack = set(), [code] if code else []
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def _pickling(functions):
    """The names, among `functions` {name: function}, of those that pickle:
    directly, or through another of them (a helper like check_pickling)."""
    uses = {name: _names_used(f) for name, f in functions.items()}
    found = {name for name, used in uses.items() if used & _PICKLING_NAMES}
    while True:
        more = {name for name, used in uses.items() if used & found} - found
        if not more:
            return found
        found |= more


# The swap: pickle.dumps/pickle.dump as ForkingPickler, counted.
_calls = {"dumps": 0}


def _forking_dumps(obj, protocol=None, *, fix_imports=True, buffer_callback=None):
    _calls["dumps"] += 1
    if buffer_callback is None and fix_imports:
        return bytes(ForkingPickler.dumps(obj, protocol))
    buf = io.BytesIO()
    ForkingPickler(buf, protocol, fix_imports, buffer_callback).dump(obj)
    return buf.getvalue()


def _forking_dump(obj, file, protocol=None, *, fix_imports=True, buffer_callback=None):
    file.write(
        _forking_dumps(
            obj, protocol, fix_imports=fix_imports, buffer_callback=buffer_callback
        )
    )


def _run_swapped(test, *args, **kwargs):
    """Runs `test` with pickle.dumps/dump swapped for ForkingPickler + torchshm
    (every array of at least a byte is shared); returns how often it pickled."""
    before = _calls["dumps"]
    threshold = torchshm.get_threshold()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pickle, "dumps", _forking_dumps)
        patch.setattr(pickle, "dump", _forking_dump)
        torchshm.set_threshold(1)
        try:
            test(*args, **kwargs)
        finally:
            torchshm.set_threshold(threshold)
    return _calls["dumps"] - before


def _through_torchshm(test, key):
    """The upstream `test`, run swapped; a deliberate difference must fail
    (a strict xfail, decided per parameter set)."""
    reason, applies = DELIBERATE_DIFFERENCES.get(key, (None, None))

    @functools.wraps(test)  # keeps its signature (fixtures) and its marks
    def run(*args, **kwargs):
        if reason is None or (applies is not None and not applies(**kwargs)):
            assert _run_swapped(test, *args, **kwargs), f"{key}: nothing pickled"
            return
        try:
            _run_swapped(test, *args, **kwargs)
        except AssertionError as exc:
            pytest.xfail(f"deliberate difference: {reason} ({exc!r:.200})")
        pytest.fail(f"[XPASS(strict)] listed as a deliberate difference: {reason}")

    run.pytestmark = list(getattr(test, "pytestmark", []))  # not shared
    return run


def _test_functions(namespace):
    return {
        name: value
        for name, value in namespace.items()
        if name.startswith("test") and inspect.isfunction(value)
    }


def _import(module_name):
    """The upstream module, or None (noted in NOT_SHIPPED or IMPORT_ERRORS)."""
    with warnings.catch_warnings():
        # numpy's conftest, not loaded here, registers numpy's marks (slow...).
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if module_name.startswith(exc.name or "\0"):
                NOT_SHIPPED.append(module_name)
            else:  # a test dependency is missing
                IMPORT_ERRORS[module_name] = repr(exc)
        except Exception as exc:  # noqa: BLE001 - reported by a test below
            IMPORT_ERRORS[module_name] = repr(exc)
    return None


NOT_SHIPPED, IMPORT_ERRORS = [], {}


def _load_upstream():
    """{our name: test} for every upstream test class with pickling tests (as
    a subclass showing only those) and every such test function."""
    collected = {}
    for module_name in UPSTREAM_MODULES:
        module = _import(module_name)
        if module is None:
            continue
        short = module_name.rsplit(".", 1)[1].removeprefix("test_")
        module_helpers = {
            n: f
            for n, f in vars(module).items()
            if inspect.isfunction(f) and f.__module__ == module.__name__
        }
        for class_name, cls in vars(module).items():
            if not (
                class_name.startswith("Test")
                and isinstance(cls, type)
                and cls.__module__ == module.__name__
            ):
                continue
            members = {
                n: f
                for klass in reversed(cls.__mro__)
                for n, f in vars(klass).items()
                if inspect.isfunction(f)
            }
            pickling = _pickling({**module_helpers, **members})
            tests = _test_functions(members)
            chosen = {
                n: f
                for n, f in tests.items()
                if n in pickling and f"{short}:{class_name}.{n}" not in NOT_APPLICABLE
            }
            if not chosen:
                continue
            namespace = {n: None for n in tests if n not in chosen}  # hidden
            for n, f in chosen.items():
                namespace[n] = _through_torchshm(f, f"{short}:{class_name}.{n}")
            name = f"TestUpstream_{short}_{class_name}"
            namespace["__module__"] = __name__
            namespace["__qualname__"] = name
            collected[name] = type(name, (cls,), namespace)
        for n in _pickling(module_helpers) & set(_test_functions(vars(module))):
            name = f"test_upstream_{short}_{n.removeprefix('test_')}"
            collected[name] = _through_torchshm(vars(module)[n], f"{short}:{n}")
    return collected


UPSTREAM = _load_upstream()
globals().update(UPSTREAM)


def test_the_upstream_suite_is_there_and_runs_through_torchshm():
    """Proves the swap: NumPy's own round-trip test shares its arrays."""
    assert not IMPORT_ERRORS, IMPORT_ERRORS
    if not UPSTREAM:
        pytest.skip(f"this numpy ships no test suite (not found: {NOT_SHIPPED})")
    assert f"numpy.{CORE}.tests.test_multiarray" not in NOT_SHIPPED
    before = torchshm.stats()
    assert _run_swapped(
        UPSTREAM["TestUpstream_multiarray_TestPickling"]().test_roundtrip
    )
    after = torchshm.stats()
    for counter in ("arrays_shared", "arrays_received"):
        assert after[counter] > before[counter], counter


# User-registered and legacy dtypes (issue 9, item 5).
rational = importlib.import_module(f"numpy.{CORE}._rational_tests").rational
add_triplet = importlib.import_module(f"numpy.{CORE}._struct_ufunc_tests").add_triplet


def _rationals(n):
    return np.array([rational(i - n // 2, i % 7 + 1) for i in range(n)])


def _filled(dtype, n):
    """n elements of `dtype` with distinct bytes in every field (no padding)."""
    raw = np.random.default_rng(7).integers(1, 100, n * dtype.itemsize, np.uint8)
    return raw.view(dtype)


DTYPE_CASES = {
    # NumPy's test dtype, registered like a third-party dtype (ml_dtypes...).
    "rational": lambda n: _rationals(n),
    "rational_2d_transposed": lambda n: _rationals(n).reshape(-1, 4).T,
    "struct_with_rational": lambda n: np.rec.fromarrays(
        [_rationals(n), np.arange(n) * 0.5], dtype=[("r", rational), ("x", "<f8")]
    ).view(np.ndarray),
    "struct_with_rational_subarray": lambda n: np.rec.fromarrays(
        [_rationals(2 * n).reshape(n, 2)], dtype=[("pair", rational, (2,))]
    ).view(np.ndarray),
    "struct_with_metadata": lambda n: _filled(
        np.dtype([("a", "<i4"), ("b", ">f8")], metadata={"unit": "m"}), n
    ),
    "field_with_metadata": lambda n: _filled(
        np.dtype(
            [("t", np.dtype("<f8", metadata={"unit": "s"})), ("n", "u1")], align=True
        ),
        n,
    ).copy(),
    "float_with_metadata": lambda n: np.arange(
        n, dtype=np.dtype("<f8", metadata={"k": 1})
    ),
    # The dtype _struct_ufunc_tests registers its add_triplet loop for.
    "struct_ufunc_triplet": lambda n: np.arange(3 * n, dtype="u8").view("u8,u8,u8"),
}

LAYOUTS = {
    "contiguous": lambda a: a,
    "empty": lambda a: a[:0],
    "sparse": lambda a: a[::5],  # spans 5x its bytes: sent compacted
    "read_only": lambda a: _read_only(a),
}


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _metadata(dtype):
    """The metadata of a dtype, its fields and its sub-array base, recursively."""
    nested = [_metadata(dtype.fields[name][0]) for name in dtype.names or ()]
    if dtype.subdtype is not None:
        nested.append(_metadata(dtype.subdtype[0]))
    return dict(dtype.metadata or {}), nested


def _assert_same(received, sent):
    assert received.dtype == sent.dtype, (received.dtype, sent.dtype)
    assert isinstance(received.dtype, type(sent.dtype))  # its DType class
    assert received.dtype.type is sent.dtype.type  # and its scalar type
    assert _metadata(received.dtype) == _metadata(sent.dtype)
    assert received.shape == sent.shape
    assert received.flags.writeable == sent.flags.writeable
    assert value_bytes(received) == value_bytes(sent)  # the values, bit for bit
    if sent.size:
        assert torchshm.is_shared(received)
    if sent.dtype == rational:  # rational's own ufunc loops accept it
        np.testing.assert_array_equal(np.add(received, received), np.add(sent, sent))
    if sent.dtype == np.dtype("u8,u8,u8"):
        np.testing.assert_array_equal(
            add_triplet(received, sent), add_triplet(sent, sent)
        )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", DTYPE_CASES)
def test_user_and_legacy_dtypes_roundtrip(case, layout):
    sent = LAYOUTS[layout](DTYPE_CASES[case](40))
    before = torchshm.stats()["arrays_received"]
    received = pickle.loads(ForkingPickler.dumps(sent))
    _assert_same(received, sent)
    assert torchshm.stats()["arrays_received"] > before  # not pickled by value
    # and sent on again: a received array goes by reference
    _assert_same(pickle.loads(ForkingPickler.dumps(received)), sent)


def test_user_and_legacy_dtypes_through_a_spawned_child(no_leaks, child):
    """There and back: the child rebuilds them, then sends them on itself."""
    sent = [
        LAYOUTS[layout](make(40))
        for make in DTYPE_CASES.values()
        for layout in ("contiguous", "sparse")
    ]
    c = child(mp.get_context("spawn"), children.echo)
    c.send(sent)
    received = c.receive()
    c.send(None)
    assert c.close() == 0
    for got, original in zip(received, sent):
        _assert_same(got, original)

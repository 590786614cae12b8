"""`python -m torchshm`: a report to paste into a bug report.

Versions (built for / running with), /dev/shm, the effective settings and
where each came from, registration, and a timed round trip of a large array
through a spawned child.
"""

import json
import multiprocessing as mp
import os
import platform
import sys
import time

import numpy as np
import torch

import torchshm
from torchshm import _config, _memory
from torchshm._cuda import runtime as _runtime
from torchshm._lifetime import pins as _pins
from torchshm._send import registry as _registry

ROUND_TRIP_BYTES = 64 << 20
TIMEOUT = 120


_CAP_DEFAULT = "default (1/4 of the memory this process may have, at most 4 GiB)"


def _source(env, default="default"):
    text = os.environ.get(env)
    return default if text is None else f"env {env}={text}"


def _settings():
    """(name, its variable, value, unit, where it came from) for each
    tunable."""
    rows = [
        {
            "name": "threshold",
            "value": torchshm.get_threshold(),
            "unit": "bytes",
            "source": _source("TORCHSHM_THRESHOLD"),
        },
        {
            "name": "pool cap",
            "value": _config.pool_bytes(),
            "unit": "bytes",
            "source": _source("TORCHSHM_POOL_BYTES", _CAP_DEFAULT),
        },
        {
            "name": "pool idle time",
            "value": _config.pool_idle_seconds(),
            "unit": "seconds",
            "source": _source("TORCHSHM_POOL_IDLE_SECONDS"),
        },
        {
            "name": "mapping cache cap",
            "value": _config.mapping_cache_bytes(),
            "unit": "bytes",
            "source": _source("TORCHSHM_MAPPING_CACHE_BYTES", _CAP_DEFAULT),
        },
        {
            "name": "GPU pin cap",
            "value": _config.pin_bytes(),
            "unit": "bytes",
            "source": _source("TORCHSHM_PIN_BYTES", _CAP_DEFAULT),
        },
        {
            "name": "copy threads",
            "value": _config.copy_threads(),
            "unit": "threads",
            "source": "default (CPUs, at most 4)",
        },
    ]
    for row in rows:
        row["variable"] = _config.REPORT_NAMES.get(row["name"])
    return rows


def _dev_shm():
    try:
        st = os.statvfs("/dev/shm")
    except OSError as exc:
        return {"error": str(exc)}
    return {
        "size": st.f_blocks * st.f_frsize,
        "free": st.f_bavail * st.f_frsize,
    }


def _echo(inbox, outbox):
    """The spawned child: says whether what it got is shared, sends it back,
    and sends a fresh array of its own."""
    import torchshm  # noqa: F401 - registers in the child

    outbox.put("ready")
    array = inbox.get(timeout=TIMEOUT)
    fresh = np.arange(array.size, dtype=array.dtype)
    outbox.put((torchshm.is_shared(array), array, fresh))
    inbox.get(timeout=TIMEOUT)  # stays until the parent has read the reply


def round_trip(nbytes=ROUND_TRIP_BYTES):
    """Sends an array to a spawned child and back; the result and its times."""
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_echo, args=(inbox, outbox), daemon=True)
    result = {"bytes": nbytes, "ok": False}
    try:
        sent = np.arange(nbytes // 8, dtype=np.float64)
        start = time.perf_counter()
        child.start()
        if outbox.get(timeout=TIMEOUT) != "ready":
            raise RuntimeError("the child did not start")
        result["child_start_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        inbox.put(sent)
        child_saw_shared, echoed, fresh = outbox.get(timeout=TIMEOUT)
        result["seconds"] = time.perf_counter() - start
        inbox.put(None)
        result.update(
            {
                "child_received_shared": bool(child_saw_shared),
                "received_shared": bool(
                    torchshm.is_shared(echoed) and torchshm.is_shared(fresh)
                ),
                "equal": bool(
                    np.array_equal(echoed, sent) and np.array_equal(fresh, sent)
                ),
            }
        )
        result["ok"] = result["equal"] and (
            not _registry.is_registered()
            or (result["child_received_shared"] and result["received_shared"])
        )
        del echoed, fresh
        child.join(TIMEOUT)
        result["child_exitcode"] = child.exitcode
        result["ok"] = result["ok"] and child.exitcode == 0
    except Exception as exc:  # the report says what failed; never a traceback
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if child.is_alive():
            child.kill()
            child.join(TIMEOUT)
    return result


def report(check=True):
    """Everything `python -m torchshm` prints, as a dict."""
    from torchshm._native import _C

    info = {
        "torchshm": torchshm.__version__,
        "torchshm_path": os.path.dirname(torchshm.__file__),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "torch": {"running": torch.__version__, "built_for": _C.built_with_torch},
        "numpy": {"running": np.__version__, "built_for": _C.built_with_numpy},
        "dev_shm": _dev_shm(),
        "memory_bound": dict(zip(("room", "by", "limit"), _memory.bound())),
        "settings": _settings(),
        "registered": _registry.is_registered(),
        "registration_source": _source("TORCHSHM_DISABLE", "import torchshm"),
        "sharing_strategy": torch.multiprocessing.get_sharing_strategy(),
        "gpu": {
            "cuda_in_use": _runtime.active().in_use(),
            "pinned_bytes": _pins.pinned_bytes(),
        },
        "cpus": os.cpu_count(),
    }
    if check:
        info["round_trip"] = round_trip()
    return info


def _size(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _value(setting):
    if setting["unit"] == "bytes":
        return f"{_size(setting['value'])} ({setting['value']} bytes)"
    return f"{setting['value']} {setting['unit']}"


def format_report(info):
    lines = [
        f"torchshm {info['torchshm']} ({info['torchshm_path']})",
        f"Python   {info['python']} ({info['python_executable']})",
        f"platform {info['platform']}, {info['cpus']} CPUs",
        f"torch    {info['torch']['running']} running,"
        f" extension built for {info['torch']['built_for']}",
        f"numpy    {info['numpy']['running']} running,"
        f" extension built for {info['numpy']['built_for']}",
    ]
    shm = info["dev_shm"]
    if "error" in shm:
        lines.append(f"/dev/shm unreadable: {shm['error']}")
    else:
        lines.append(f"/dev/shm {_size(shm['size'])}, {_size(shm['free'])} free")
    bound = info["memory_bound"]
    lines.append(
        f"memory   {_size(bound['room'])} left for shared memory, bounded by"
        f" {bound['by']} (torchshm does not use /dev/shm: `python -m torchshm"
        " doctor`)"
    )
    lines.append("settings:")
    for s in info["settings"]:
        variable = s.get("variable") or "-"
        lines.append(f"  {s['name']:<18} {variable:<29} {_value(s)}  [{s['source']}]")
    state = "registered" if info["registered"] else "NOT registered"
    lines.append(
        f"reducers {state} with ForkingPickler [{info['registration_source']}]"
    )
    lines.append(f"torch sharing strategy {info['sharing_strategy']}")
    gpu = info["gpu"]
    lines.append(
        f"GPU      {_size(gpu['pinned_bytes'])} pinned in place by this process"
        + ("" if gpu["cuda_in_use"] else " (no CUDA context here: nothing is pinned)")
    )
    rt = info.get("round_trip")
    if rt is not None:
        if "error" in rt:
            lines.append(f"spawn round trip FAILED: {rt['error']}")
        else:
            verdict = "ok" if rt["ok"] else "FAILED"
            lines.append(
                f"spawn round trip {verdict}: {_size(rt['bytes'])} to a spawned child"
                f" and back in {rt['seconds'] * 1e3:.1f} ms (the child started in"
                f" {rt['child_start_seconds']:.2f} s);"
                f" shared there: {rt['child_received_shared']},"
                f" shared back: {rt['received_shared']}, equal: {rt['equal']},"
                f" child exit code {rt['child_exitcode']}"
            )
    return "\n".join(lines)


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m torchshm",
        description=(
            "Prints torchshm's diagnostic report (paste it into a bug report);"
            " `doctor`: what bounds shared memory here, the live sessions and"
            " what a container needs; `ls`: this user's segments."
        ),
    )
    parser.add_argument(
        "command", nargs="?", default="report", choices=("report", "doctor", "ls")
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--no-check", action="store_true", help="skip the spawn round trip"
    )
    args = parser.parse_args(argv)
    if args.command != "report":
        from torchshm._tools import doctor as _doctor

        return _doctor.main(args.command, args.json)
    info = report(check=not args.no_check)
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    rt = info.get("round_trip")
    return 0 if rt is None or rt["ok"] else 1

"""`python -m torchshm doctor` and `python -m torchshm ls`.

doctor: what bounds shared memory here (the /dev/shm mount, the memory
cgroup, the machine), which of them bounds torchshm (not /dev/shm: its
segments are memfds, Note [Segment lifetime] in csrc/lifetime/segment.h), the live
torchshm sessions of this user with what each holds, and what a container
needs. ls: this user's segments and their holders, one row each.
"""

import collections
import json
import os
import stat

from torchshm import _memory
from torchshm._lifetime import attach as _attach
from torchshm._keeper import paths as _paths
from torchshm._lifetime import session as _session
from torchshm._send import tensors as _tensors

# How a segment's mapping reads in /proc/<pid>/maps.
SEGMENT_MAPPING = _attach.SEGMENT_LINK

TORCH_SHM_NOTE = (
    "torch's own tensor sharing (its file_descriptor and file_system"
    " strategies) uses /dev/shm: tensors in DataLoader samples, and the"
    " default collate's batches, need room there"
)
TENSOR_SWITCH = (
    "torchshm sends torch's CPU tensors through its own memory instead (the"
    " tensor switch, on by default; TORCHSHM_TENSORS=0 or"
    " torchshm.register(tensors=False) turns it off: then raise --shm-size)"
)


def sessions():
    """Ids of this user's torchshm sessions whose keeper socket exists."""
    found = []
    try:
        directory = _paths.run_dir()
        names = os.listdir(directory)
    except OSError:
        return found
    for name in names:
        if not (name.startswith(_paths.PREFIX) and name.endswith(".sock")):
            continue
        try:
            st = os.lstat(os.path.join(directory, name))
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
            found.append(name[len(_paths.PREFIX) : -len(".sock")])
    return sorted(found)


def reports():
    """The keeper's report of every live session of this user."""
    out = []
    for session in sessions():
        report = _session.status(session)
        if report is not None:
            out.append(report)
    return out


def diagnose():
    """doctor's findings, as a dict."""
    try:
        st = os.statvfs("/dev/shm")
        dev_shm = {"size": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}
    except OSError as exc:
        dev_shm = {"error": str(exc)}
    cgroup = _memory.cgroup_limit()
    info = _memory.meminfo()
    room, bound_by, limit = _memory.bound()
    live = reports()
    own = _session._session  # noqa: SLF001 - not joined: no session of our own
    return {
        "dev_shm": dev_shm,
        "cgroup": (
            None
            if cgroup is None
            else {"limit": cgroup[0], "usage": cgroup[1], "file": cgroup[2]}
        ),
        "memory": {
            "total": info.get("MemTotal", 0),
            "available": info.get("MemAvailable", 0),
            "shmem": info.get("Shmem", 0),
        },
        "bound": {"room": room, "by": bound_by, "limit": limit},
        "sessions": [
            {
                "session": r["session"],
                "keeper_pid": r["pid"],
                "members": r["members"],
                "segments": len(r["segments"]),
                "bytes": sum(s["bytes"] for s in r["segments"]),
                "this_process": r["session"] == own,
            }
            for r in live
        ],
        "advice": _advice(dev_shm, cgroup),
    }


def _advice(dev_shm, cgroup):
    advice = [
        "torchshm's arrays do not use /dev/shm: a container needs no --shm-size"
        " for them (Docker's and Kubernetes' 64 MiB default is fine).",
    ]
    if "size" in dev_shm and dev_shm["size"] < 1 << 30:
        switch = "on" if _tensors.enabled() else "off"
        advice.append(
            f"/dev/shm is {_memory._size(dev_shm['size'])}: {TORCH_SHM_NOTE};"
            f" {TENSOR_SWITCH} (the tensor switch is {switch} here)."
        )
    if cgroup is not None:
        advice.append(
            f"Shared memory counts against this container's memory limit"
            f" ({_memory._size(cgroup[0])}, {cgroup[2]}): arrays in flight, the"
            " senders' pools (TORCHSHM_POOL_BYTES) and the receivers' mapping"
            " caches (TORCHSHM_MAPPING_CACHE_BYTES) all do. When it is reached,"
            " arrays are pickled by value instead, with one warning."
        )
    return advice


def format_diagnosis(d):
    size = _memory._size
    lines = []
    shm = d["dev_shm"]
    if "error" in shm:
        lines.append(f"/dev/shm      unreadable: {shm['error']}")
    else:
        lines.append(f"/dev/shm      {size(shm['size'])}, {size(shm['free'])} free")
    if d["cgroup"] is None:
        lines.append("memory cgroup no limit")
    else:
        c = d["cgroup"]
        lines.append(
            f"memory cgroup limit {size(c['limit'])}, {size(c['usage'])} in use"
            f" ({c['file']})"
        )
    m = d["memory"]
    lines.append(
        f"memory        {size(m['total'])} in all, {size(m['available'])} available,"
        f" {size(m['shmem'])} shared"
    )
    b = d["bound"]
    lines.append(f"torchshm      bounded by {b['by']}: {size(b['room'])} left")
    if not d["sessions"]:
        lines.append("sessions      none of this user")
    for s in d["sessions"]:
        mine = " (this process)" if s["this_process"] else ""
        lines.append(
            f"session       {s['session']}{mine}: keeper pid {s['keeper_pid']},"
            f" {s['members']} processes, {s['segments']} segments,"
            f" {size(s['bytes'])}"
        )
    lines.extend(f"advice        {a}" for a in d["advice"])
    return "\n".join(lines)


def segments():
    """One row per segment of this user: session, index, uid, sizes, holders
    (each as its process: pid and command)."""
    rows = []
    for r in reports():
        for s in r["segments"]:
            row = dict(s, session=r["session"])
            row["creator_process"] = holder_process(s["creator"])
            row["holder_processes"] = [holder_process(h) for h in s["holders"]]
            rows.append(row)
    return rows


def holder_process(holder):
    """{"pid", "command"} of the process a holder id (16 hex digits) names,
    from its lock file ("<pid> <session>") and /proc; pid None once it is
    gone."""
    pid = None
    try:
        fd = _paths.open_own_file(_paths.process_lock_path(int(holder, 16)))
    except OSError:
        fd = None
    if fd is not None:
        try:
            words = os.read(fd, 256).split()
            pid = int(words[0]) if words and words[0].isdigit() else None
        finally:
            os.close(fd)
    command = None
    if pid is not None:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                raw = f.read().replace(b"\0", b" ").decode(errors="replace")
            command = " ".join(raw.split())
        except OSError:
            command = None  # another PID namespace, or gone meanwhile
    return {"holder": holder, "pid": pid, "command": command}


def _process(p):
    if p["pid"] is None:
        return f"{p['holder']} (gone)"
    command = _printable(p["command"] or "?")[:48]
    return f"pid {p['pid']} ({command})"


def _printable(text):
    """`text` with what a terminal would act on (escape sequences, other
    control characters) written as Python escapes: a command line is
    whatever its process chose."""
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
        for c in text
    )


def format_segments(rows):
    if not rows:
        return "no torchshm segments of this user"
    size = _memory._size
    header = (
        f"{'session':<13}{'index':>6} {'uid':<17}{'capacity':>11}{'in memory':>11}"
        f"{'tickets':>8} pinned  creator, holders"
    )
    lines = [header]
    for r in rows:
        counts = collections.Counter(_process(p) for p in r["holder_processes"])
        holders = "; ".join(
            who if n == 1 else f"{who} x{n}" for who, n in counts.items()
        )
        pinned = "yes" if r["pinned"] else "no"
        lines.append(
            f"{r['session']:<13}{r['index']:>6} {r['uid']:<17}{size(r['capacity']):>11}"
            f"{size(r['bytes']):>11}{r['tickets']:>8} {pinned:<6}"
            f" {_process(r['creator_process'])}, held by: {holders or 'none'}"
        )
    return "\n".join(lines)


def segment_pss(pid="self"):
    """PSS in bytes of the torchshm segments a process maps (its share of
    each page, so summing over the processes that map one gives its size)."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if not fields:
                continue
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and fields[5].startswith(SEGMENT_MAPPING)
            elif fields[0] == "Pss:" and inside:
                total += int(fields[1]) * 1024
    return total


def main(command, as_json):
    if command == "doctor":
        found = diagnose()
        print(json.dumps(found, indent=2) if as_json else format_diagnosis(found))
    else:
        rows = segments()
        print(json.dumps(rows, indent=2) if as_json else format_segments(rows))
    return 0

"""11. Metadata-heavy dataset: Python objects in DataLoader workers (issue 21).

COCO-like records (a dict: an id, a file name, 4 boxes, a category), every
worker of a DataLoader reading every record once per epoch, 2 epochs with
persistent workers, 1/2/4/8 workers, fork and spawn:

- plain list: each worker gets its own copy, pickled under spawn, and under
  fork copied page by page, because reading a record writes its reference
  counts (pytorch#13246);
- SharedList: `torchshm.share(dataset, containers=True)` first, which packs
  the records once into shared memory;
- empty: the same loader over no records, the processes' own baseline;
- threads: one process, a thread per worker reading the plain list
  (torchdata.nodes.ParallelMapper(method="thread") where torchdata has it,
  else a ThreadPoolExecutor), the no-processes reference.

Columns: total PSS of the main process and its workers at the end of each
epoch, read once every worker has finished reading (PSS is a snapshot);
worker start (epoch 1, from iter(loader) until the last worker began
reading); records read per second, all workers together (epoch 2); CPU time
of a worker per record read (epoch 2: index, decode for a SharedList, and
reading every field).

TORCHSHM_BENCH_RECORDS sets the number of records (default 500,000;
--quick: 20,000). A plain-list run that would need more than MEMORY_SHARE of
the available memory (a copy per worker) is skipped and says so.

Note [Metadata scenario size]

The issue's 2,000,000 records took 15 min
on the 2-core reference machine (busy), most of it the plain list's spawn
workers (each gets 2.4 GiB pickled: 88 s to start one) and 8 workers
unpickling 2,000,000 records each, twice; and a plain list of them cannot
be copied into 4 or 8 workers in 24 GiB. 500,000 records (0.6 GiB as a
list) run every row in about 5 min; docs/guide/objects.md quotes both.
"""

import functools
import gc
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import torch.utils.data
from torch.utils.data import DataLoader

import torchshm
from benchmarks.report import Result, fmt

NAME = "metadata"
RECORDS = 500_000
QUICK_RECORDS = 20_000
WORKERS = (1, 2, 4, 8)
QUICK_WORKERS = (1, 2)
CONTEXTS = ("fork", "spawn")
EPOCHS = 2
MEMORY_SHARE = 0.6
TIMEOUT = 900  # seconds a DataLoader may wait for a worker's report
METRIC = "PSS, epoch 2"


def make_records(n, seed=0):
    """The records, one at a time (a SharedList never holds them all)."""
    rng = random.Random(seed).random
    for i in range(n):
        yield {
            "id": i,
            "file_name": f"{i:012d}.jpg",
            "boxes": [
                [rng() * 640, rng() * 480, rng() * 200, rng() * 200] for _ in "xyzw"
            ],
            "category": i % 80,
        }


def touch(record):
    """What a worker does with a record here: read every field."""
    total = record["id"] + record["category"] + len(record["file_name"])
    for box in record["boxes"]:
        total += box[0] + box[1] + box[2] + box[3]
    return total


def read_all(records, worker=None):
    """Reads every record by index; the report a worker sends once done."""
    begin, cpu = time.monotonic(), time.thread_time()
    total = 0.0
    for i in range(len(records)):
        total += touch(records[i])
    return {
        "pid": os.getpid(),
        "begin": begin,
        "cpu": time.thread_time() - cpu,
        "n": len(records),
    }


class ReadEveryRecord(torch.utils.data.IterableDataset):
    """Every worker reads every record, then yields one report."""

    def __init__(self, records):
        self.records = records

    def __iter__(self):
        yield read_all(self.records)


def pss_bytes(pid):
    """(PSS, PSS of file-backed pages) of a process, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("Pss", "Pss_File"):
                fields[name] = int(value.split()[0]) * 1024
    return fields["Pss"], fields.get("Pss_File", 0)


def _epoch(reports, start, done, pids):
    """One epoch's figures, read after every worker reported (a barrier).

    Note [PSS of libraries]

    A shared library's pages are split among every process of the machine
    that maps them, so on a machine where other Pythons run torch, the
    workers' PSS moves by tens of MiB from run to run with no change here.
    The PSS without file-backed pages (anonymous memory and shared memory:
    the records, their buffers, the heaps) does not; it is reported beside
    the total."""
    pss = [pss_bytes(pid) for pid in pids]
    return {
        "pss": sum(total for total, _ in pss),
        "pss_anon": sum(total - files for total, files in pss),
        "start": max(r["begin"] for r in reports) - start,
        "records_per_s": sum(r["n"] for r in reports) / (done - start),
        "cpu_per_record": statistics.mean(r["cpu"] / max(1, r["n"]) for r in reports),
    }


def run_loader(records, context, workers):
    loader = DataLoader(
        ReadEveryRecord(records),
        batch_size=None,
        num_workers=workers,
        multiprocessing_context=context,
        persistent_workers=True,
        worker_init_fn=torchshm.worker_init_fn,
        timeout=TIMEOUT,
    )
    epochs = []
    try:
        for _ in range(EPOCHS):
            start = time.monotonic()
            reports = list(loader)
            done = time.monotonic()
            pids = [os.getpid()] + [r["pid"] for r in reports]
            epochs.append(_epoch(reports, start, done, pids))
    finally:
        if loader._iterator is not None:  # persistent workers: stop them now
            loader._iterator._shutdown_workers()
        del loader
    return epochs


def _thread_loader(records, workers):
    """(epoch function, what it is): torchdata's thread mapper, else a pool."""
    read = functools.partial(read_all, records)
    try:
        from torchdata import nodes

        mapper = nodes.ParallelMapper(
            nodes.IterableWrapper(range(workers)),
            map_fn=read,
            num_workers=workers,
            method="thread",
            in_order=False,
        )
        loader = nodes.Loader(mapper)
        return (lambda: list(loader)), "torchdata.nodes.ParallelMapper(method='thread')"
    except ImportError:

        def epoch():
            with ThreadPoolExecutor(workers) as pool:
                return list(pool.map(read, range(workers)))

        return epoch, "ThreadPoolExecutor"


def run_threads(records, workers):
    epoch, kind = _thread_loader(records, workers)
    epochs = []
    for _ in range(EPOCHS):
        start = time.monotonic()
        reports = epoch()
        epochs.append(_epoch(reports, start, time.monotonic(), [os.getpid()]))
        epochs[-1]["start"] = None  # no process starts
    return epochs, kind


def _main_pss():
    gc.collect()
    return pss_bytes(os.getpid())[0]


def run(quick, bar):
    n = (
        QUICK_RECORDS
        if quick
        else int(os.environ.get("TORCHSHM_BENCH_RECORDS", RECORDS))
    )
    workers = QUICK_WORKERS if quick else WORKERS
    result = Result(
        NAME,
        f"11. Metadata-heavy dataset: {n:,} records read by every DataLoader"
        " worker, total PSS",
        unit="B",
        notes=[
            "PSS: main process + workers at the end of the epoch, after every"
            " worker finished reading; without file pages: less the libraries'"
            " share, which other processes of the machine move (Note [PSS of"
            " libraries]). Ratio: SharedList against its buffers + the empty"
            " run (in parentheses: without file pages). Worker start: epoch 1."
            " Records/s and CPU per record (index, decode, read every field):"
            " epoch 2.",
        ],
    )
    bar.reset(total=len(workers) * (3 * len(CONTEXTS) + 1))
    runs = {}  # (method, context, workers) -> epochs

    before = _main_pss()
    records = list(make_records(n))
    list_bytes = _main_pss() - before
    for w in workers:
        runs["plain list", "threads", w], kind = run_threads(records, w)
        bar.update()
    result.notes.append(f"threads: {kind}, over the plain list.")
    available = psutil.virtual_memory().available
    for context in CONTEXTS:
        for w in workers:
            # A copy of the records in every worker, plus one pickled in
            # flight under spawn.
            needs = (w + 1 + (context == "spawn")) * list_bytes
            if needs > MEMORY_SHARE * available:
                result.notes.append(
                    f"plain list, {context}, {w} workers: skipped, it needs about"
                    f" {fmt(needs, 'B')} ({fmt(available, 'B')} available)."
                )
            else:
                runs["plain list", context, w] = run_loader(records, context, w)
            bar.update()

    begin = time.monotonic()
    dataset = torchshm.share(ReadEveryRecord(records), containers=True)
    shared = dataset.records
    shared_seconds = time.monotonic() - begin
    del records
    buffers = shared.nbytes
    result.notes.append(
        f"The plain list: {fmt(list_bytes, 'B')} of Python objects; the"
        f" SharedList's buffers: {fmt(buffers, 'B')}, made by"
        f" share(dataset, containers=True) in {shared_seconds:.1f} s."
    )
    for context in CONTEXTS:
        for w in workers:
            runs["SharedList", context, w] = run_loader(shared, context, w)
            bar.update()
    del dataset, shared
    for context in CONTEXTS:
        for w in workers:
            runs["empty", context, w] = run_loader([], context, w)
            bar.update()
    _report(result, runs, workers, buffers)
    return result


def _report(result, runs, workers, buffers):
    for (method, context, w), epochs in runs.items():
        first, last = epochs[0], epochs[-1]
        unit = "thread" if context == "threads" else f"{context} worker"
        case = f"{w} {unit}{'s' if w > 1 else ''}: {method}"
        result.add(case, METRIC, [last["pss"]], warmup=0)
        result.extra(case, "PSS, epoch 1", fmt(first["pss"], "B"))
        empty = runs.get(("empty", context, w))
        result.extra(case, "without file pages", fmt(last["pss_anon"], "B"))
        if method == "SharedList" and empty is not None:
            reference = buffers + empty[-1]["pss"]
            anon = last["pss_anon"] / (buffers + empty[-1]["pss_anon"])
            result.extra(case, "buffers + empty", fmt(reference, "B"))
            result.extra(case, "ratio", f"{last['pss'] / reference:.2f}x ({anon:.2f}x)")
        start = first["start"]
        result.extra(case, "worker start", "" if start is None else fmt(start, "s"))
        if method != "empty":
            result.extra(case, "records/s", f"{last['records_per_s'] / 1e6:.2f} M")
            result.extra(case, "us per record", f"{last['cpu_per_record'] * 1e6:.2f}")

    def pss(method, context):
        return [
            runs[method, context, w][-1]["pss"]
            if (method, context, w) in runs
            else None
            for w in workers
        ]

    series = {"plain list, threads (one process)": pss("plain list", "threads")}
    styles = {"plain list, threads (one process)": {"color": "tab:blue"}}
    for context, line in (("fork", "-"), ("spawn", ":")):
        for method, color in (("plain list", "tab:red"), ("SharedList", "tab:green")):
            label = f"{method}, {context}"
            series[label] = pss(method, context)
            styles[label] = {"color": color, "linestyle": line}
        label = f"SharedList's buffers + empty, {context}"
        series[label] = [
            None if e is None else e + buffers for e in pss("empty", context)
        ]
        styles[label] = {"color": "tab:gray", "linestyle": line, "marker": "x"}
    result.summary["lines"] = {
        "x": list(workers),
        "xlabel": "DataLoader workers (each reads every record)",
        "ylabel": "total PSS at the end of epoch 2 (GiB)",
        "series": series,
        "styles": styles,
    }
    _conclusions(result, runs, workers, buffers)


def _conclusions(result, runs, workers, buffers):
    w = workers[-1]
    for context in CONTEXTS:
        shared, empty = runs["SharedList", context, w], runs["empty", context, w]
        ratio = shared[-1]["pss"] / (buffers + empty[-1]["pss"])
        anon = shared[-1]["pss_anon"] / (buffers + empty[-1]["pss_anon"])
        flat = shared[-1]["pss"] / shared[0]["pss"]
        start = shared[0]["start"] / empty[0]["start"]
        result.summary[f"{context}_ratio_to_reference"] = ratio
        result.summary[f"{context}_ratio_without_file_pages"] = anon
        result.summary[f"{context}_epoch2_over_epoch1"] = flat
        result.summary[f"{context}_start_over_empty"] = start
        plain = runs.get(("plain list", context, w))
        plain = "skipped" if plain is None else fmt(plain[-1]["pss"], "B")
        result.notes.append(
            f"{context}, {w} workers: SharedList total PSS"
            f" {fmt(shared[-1]['pss'], 'B')} = {ratio:.2f}x its buffers + the"
            f" empty run ({anon:.2f}x without file pages), epoch 2 / epoch 1"
            f" {flat:.2f}; worker start"
            f" {start:.2f}x the empty dataset's; plain list {plain}."
        )

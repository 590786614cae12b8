"""Child targets for test_tensors.py (module top level: spawn imports them).
Every child turns the tensor switch on itself (a spawned child reads the
environment its parent had when it started), and computes with one thread:
a forked child's first parallel torch op waits forever for the OpenMP pool
of its parent (libgomp)."""

import os
import resource
import time

import torch

import torchshm
from torchshm import _C
from torchshm._compat import int8_tensor_over, untyped_storage


def start():
    torch.set_num_threads(1)
    torchshm.register(tensors=True)


def segment_name(tensor):
    """The torchshm segment behind a tensor's storage (a slab's for a small
    one), or None."""
    view = int8_tensor_over(untyped_storage(tensor))
    block = _C.block_of(view)
    segment = _C.segment_of(view if block is None else block[0])
    return None if segment is None else segment.name


def describe(tensor):
    return dict(
        dtype=tensor.dtype,
        shape=tuple(tensor.shape),
        stride=tensor.stride(),
        offset=tensor.storage_offset(),
        requires_grad=tensor.requires_grad,
        type=type(tensor),
        shared=tensor.is_shared(),
        segment=segment_name(tensor) is not None,
    )


def echo(inbox, outbox):
    """Sends back each tensor it receives, with what it saw of it."""
    start()
    while (item := inbox.get()) is not None:
        outbox.put((item, describe(item) if torch.is_tensor(item) else None))


def write_and_wait(inbox, outbox):
    """Writes 7 into the first element of the tensor it gets, says so, then
    reports what the first element holds when asked (the parent's write)."""
    start()
    tensor = inbox.get()
    tensor[0] = 7
    outbox.put(("written", tensor.is_shared()))
    inbox.get()
    outbox.put(float(tensor[0]))


def same_storage(inbox, outbox):
    """Receives two messages that name one storage and reports whether the
    tensors share one storage (and alias each other's bytes)."""
    start()
    first, second = inbox.get(), inbox.get()
    a, b = first[0], second[0]
    together = first[1]
    outbox.put(
        (
            untyped_storage(a).data_ptr() == untyped_storage(b).data_ptr(),
            untyped_storage(a).data_ptr() == untyped_storage(together).data_ptr(),
            a.data_ptr() == untyped_storage(a).data_ptr() + a.storage_offset() * 4,
        )
    )


def send_and_exit(outbox, n):
    """Sends one fresh tensor and exits at once."""
    start()
    outbox.put(torch.arange(n, dtype=torch.float64))
    outbox.close()
    outbox.join_thread()


def hold_many(inbox, outbox, nofile):
    """Under `ulimit -n nofile`, receives tensors until None and holds them
    all; reports how many arrived intact and how many fds it has open."""
    start()
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    held = []
    try:
        while (item := inbox.get()) is not None:
            held.append(item)
        good = sum(bool((t == i).all()) for i, t in enumerate(held))
        outbox.put(
            dict(received=len(held), good=good, fds=len(os.listdir("/proc/self/fd")))
        )
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        outbox.put(dict(received=len(held), error=f"{type(exc).__name__}: {exc}"))


def torchs_path(inbox, outbox, switch, torch_shared):
    """Sends a tensor to itself with torch's own reducers in charge (the
    switch off, or a tensor torch shared first); reports what it saw. In a
    child: torch's fd path leaves an fd with multiprocessing's resource
    sharer until a receiver fetches it, and a child takes that along."""
    from multiprocessing.reduction import ForkingPickler

    torch.set_num_threads(1)
    torchshm.register(tensors=switch)
    tensor = torch.ones(1000)
    if torch_shared:
        tensor.share_memory_()
    before = untyped_storage(tensor).data_ptr()
    back = ForkingPickler.loads(ForkingPickler.dumps(tensor))
    outbox.put(
        dict(
            in_segment=segment_name(tensor) is not None,
            back_in_segment=segment_name(back) is not None,
            shared=tensor.is_shared(),
            equal=torch.equal(back, tensor),
            moved=untyped_storage(tensor).data_ptr() != before,
        )
    )


def send_tensors_and_wait(outbox, count, nbytes):
    """Sends `count` fresh tensors, then waits to be killed."""
    start()
    for i in range(count):
        outbox.put(torch.full((nbytes // 8,), float(i), dtype=torch.float64))
    time.sleep(120)


def send_under_fd_limit(inbox, outbox, count, hard):
    """Under a hard fd limit of `hard`, sends `count` fresh tensors held
    here: past a quarter of the limit torchshm cannot make segments, and
    torch's own path must carry the rest (its receivers fetch their fds from
    this process: it waits for the parent's word)."""
    start()
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # 128 KiB each: a storage of up to 64 KiB takes a block of a slab, no fd.
    held = [torch.full((1 << 15,), float(i)) for i in range(count)]
    for t in held:
        outbox.put(t)
    inbox.get()  # all received: the feeder pickled them all
    outbox.put(torchshm.stats()["fallbacks"])
    inbox.get()


def forward_base(inbox, outbox, switch, value):
    """Receives a uint8 array, writes `value` into its first byte unless
    None, and sends on the int8 tensor under it (its .base), with the
    array's offset there; then holds both until told to go."""
    torch.set_num_threads(1)
    torchshm.register(tensors=switch)
    array = inbox.get()
    if value is not None:
        array[0] = value
    at = array.__array_interface__["data"][0] - array.base.data_ptr()
    outbox.put((array.base, at))
    inbox.get()
    outbox.put(int(array[0]))


def write_received_tensor(inbox, outbox, switch):
    """Receives (tensor, at, value): reports the byte at `at`, writes `value`
    there, and reports it read back; holds the tensor until told to go."""
    torch.set_num_threads(1)
    torchshm.register(tensors=switch)
    tensor, at, value = inbox.get()
    first = int(tensor[at])
    tensor[at] = value
    outbox.put((first, int(tensor[at])))
    inbox.get()


def hold_small(inbox, outbox):
    """Receives a list of small tensors and holds them: reports how many
    hold their index, whether each lies in torchshm's memory, and this
    process's open fds; then writes 99 into the first one's first element,
    says so, and holds them until told to go."""
    start()
    held = inbox.get()
    outbox.put(
        dict(
            good=sum(bool((t == i).all()) for i, t in enumerate(held)),
            ours=sum(segment_name(t) is not None for t in held),
            fds=len(os.listdir("/proc/self/fd")),
        )
    )
    held[0][0] = 99
    outbox.put("written")
    inbox.get()


def free_inherited_and_send(inbox, outbox):
    """A forked child: drops the small tensor it inherited, then sends a new
    small tensor (carved from a slab of its own) and its parent's values."""
    start()
    inherited = inbox.get()
    outbox.put(torch.full((32,), 5.0))
    del inherited
    inbox.get()


def send_small_one_by_one(inbox, outbox, count):
    """Sends `count` small tensors, one message each, each dropped here and
    received there before the next is made; then waits for the word."""
    start()
    for i in range(count):
        outbox.put(torch.full((64,), float(i)))
        inbox.get()
    inbox.get()

"""One copy per node across torch.distributed ranks.

    import torch.distributed as dist, torchshm.distributed as tsd
    dist.init_process_group("gloo")
    table = tsd.share_on_node(build=load_big_table)  # built once per node

On each node one rank builds the object (or takes `obj`), moves it into shared
memory (torchshm.share) and exports a handle (torchshm.dumps); the handles
travel through torch.distributed's object collectives, and the node's other
ranks load theirs. Every rank gets an equivalent object over the same shared
memory, which its DataLoader workers (fork, spawn, forkserver) map too: the
object pickles to them by reference.

"Same node" means "sees the same /dev/shm", not "same hostname": two
containers of one host with separate /dev/shm mounts are two nodes, two that
share it (--ipc=host) are one. A rank that cannot load its node's handle
anyway makes a copy of its own, with one warning.
"""

import os
from typing import Any, Callable, Optional

from torchshm import _fallback, _handles
from torchshm import _share

__all__ = ["node_key", "share_on_node"]


def node_key():
    """What identifies the shared memory this process sees: its node.

    The kernel's boot id (one per machine and boot; containers of one host
    share it) and the device of the ``/dev/shm`` mount (each tmpfs mount has
    its own; a bind mount of the same one, as under ``--ipc=host``, has the
    same). Not the host name: containers of one host may share ``/dev/shm``
    under different names. Processes with equal keys are on one node for
    `share_on_node`.

    Returns
    -------
    str
        ``"<boot id>:<device in hex>"`` (``"unknown-boot:..."`` where the
        boot id cannot be read).

    Raises
    ------
    OSError
        ``/dev/shm`` does not exist or cannot be examined.

    See Also
    --------
    share_on_node

    Examples
    --------
    >>> import torchshm.distributed
    >>> key = torchshm.distributed.node_key()
    >>> key == torchshm.distributed.node_key()
    True
    >>> boot_id, device = key.rsplit(":", 1)
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    st = os.stat("/dev/shm")
    return f"{boot}:{st.st_dev:x}"


def share_on_node(
    obj: Any = None,
    *,
    build: Optional[Callable[[], Any]] = None,
    group: Any = None,
) -> Any:
    """The node-shared equivalent of `obj` (or of `build()`), on every rank.

    A collective: every rank of `group` must call it. On each node the
    lowest rank of `group` that shares its ``/dev/shm`` (same `node_key`)
    takes `obj` (or calls `build()`, only there), moves it into shared
    memory (`torchshm.share`) and exports a handle (`torchshm.dumps`); the
    handles travel through torch.distributed's object collectives, and the
    node's other ranks load theirs: one copy per node. Every rank's
    DataLoader workers (fork, spawn, forkserver) map the same memory: the
    object pickles to them by reference.

    The result is read-write shared memory: a change on one rank is seen by
    the others of its node (synchronize yourself). It lives while any
    process of the node holds it; once a rank drops it, its memory there is
    gone. A rank that cannot load its node's copy (its ``/dev/shm`` is not
    the one it seemed to be) uses a shared copy of its own, with one
    ``RuntimeWarning``.

    Parameters
    ----------
    obj : object, optional
        The object to share, passed on every rank (only each node's first
        rank's is used, and that of a rank that falls back to a copy of its
        own).
    build : callable, optional
        Called with no arguments to make the object instead, only on each
        node's first rank (and on a rank that falls back to a copy of its
        own). One of `obj` and `build` is needed on every rank.
    group : ProcessGroup, optional
        The ranks taking part; ``None`` (default): the whole world.

    Returns
    -------
    object
        An equivalent of `obj` (or of ``build()``) over the node's shared
        memory.

    Raises
    ------
    RuntimeError
        torch.distributed is not available or not initialized
        (``init_process_group`` first); or, on every other rank, some node's
        first rank could not share its object (the message names that rank
        and its error).
    TypeError
        Neither `obj` nor `build` was given (raised before any collective:
        the other ranks then wait for this one).
    Exception
        On a node's first rank, whatever ``build()`` or sharing `obj` raised
        (the other ranks get the ``RuntimeError`` above instead of hanging);
        errors of torch.distributed's collectives.

    See Also
    --------
    torchshm.share, torchshm.dumps, node_key

    Examples
    --------
    >>> import torch.distributed as dist
    >>> import torchshm.distributed
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> table = torchshm.distributed.share_on_node(build=lambda: np.arange(1_000_000))
    >>> torchshm.is_shared(table)
    True
    >>> dist.destroy_process_group()

    In a job of many ranks, after ``dist.init_process_group(...)``::

        table = torchshm.distributed.share_on_node(build=load_big_table)
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torchshm.distributed.share_on_node() needs torch.distributed:"
            " call torch.distributed.init_process_group() first"
        )
    if obj is None and build is None:
        raise TypeError("share_on_node() needs obj or build")
    size = dist.get_world_size(group)
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    keys = [None] * size
    dist.all_gather_object(keys, node_key(), group=group)
    owner = keys.index(keys[me])

    value = handle = error = None
    if owner == me:
        try:
            value = _share.share(obj if obj is not None else build())
            handle = _handles.dumps(value)
        except Exception as exc:  # noqa: BLE001 - the others must not hang
            error = f"{type(exc).__name__}: {exc}"
            failure = exc
    messages = [None] * size
    dist.all_gather_object(messages, (handle, error), group=group)
    failed = [(r, e) for r, (_, e) in enumerate(messages) if e is not None]
    if failed:
        if error is not None:
            raise failure
        rank, what = failed[0]
        raise RuntimeError(f"share_on_node: rank {rank} could not share: {what}")

    if owner != me:
        try:
            value = _handles.loads(messages[owner][0])
        except Exception as exc:  # noqa: BLE001 - the others wait at the barrier
            _fallback.warn_once(
                "share_on_node",
                f"torchshm.share_on_node: rank {me} could not load the copy of"
                f" rank {owner} ({type(exc).__name__}: {exc}); using a copy of its"
                " own",
            )
            value = _share.share(obj if obj is not None else build())
    # Every rank holds its own view now: the handle is no longer needed.
    dist.barrier(group=group)
    if handle is not None:
        _handles.release(handle)
    return value

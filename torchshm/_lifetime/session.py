"""Session membership: every process that may hold torchshm memory, and its
line to the session's keeper (_keeper/daemon.py, Note [Segment lifetime] in
csrc/lifetime/segment.h).

A session is the process tree of the first process that imported torchshm. Its
id travels in the environment (spawn and forkserver children inherit it).
Every member holds one connection to the keeper, through a socket in the
user's run directory in /dev/shm (_keeper/paths.py) that any network namespace
sharing this /dev/shm reaches; the keeper sees a member die when that
connection closes. Forked children connect anew.

Nothing waits on the keeper for ever: every request has a deadline
(TORCHSHM_KEEPER_TIMEOUT). A keeper that does not answer in time (stopped,
swamped, at its fd limit) is a SharedMemoryError(ETIMEDOUT): a sender pickles
by value, a process joining starts with torchshm off (one warning each), and
its connection is closed and made anew at the next request.

Through this module a process registers the segments it creates (their fds go
to the keeper), opens the segments others created, and asks a keeper for a
status report. A keeper that died is replaced: the next process that needs
one starts it under the same session id, and every member joins it again,
registering what it created (rejoin()).
"""

import errno
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

from torchshm import _config
from torchshm._lifetime import fds as _fds
from torchshm._keeper import paths as _paths
from torchshm._keeper import protocol as _protocol
from torchshm._native import _C

ENV_VAR = "TORCHSHM_SESSION"
# How long a process that would lose a message without a keeper waits for
# one (a new one, slow to start on a loaded machine): a receiver loading it
# (_lifetime/attach.py), a sender's exit handing it over (hand_over).
KEEPER_PATIENCE = 60.0
_lock = threading.RLock()  # joining, and every request on the connection
_connection = None  # this process's member connection
_session = None
_table = None  # the session table (csrc/lifetime/table.h)
_keeper_pid = 0  # 0: not visible from this PID namespace
_foreign = {}  # session -> (table, keeper pid) of sessions we fetched from


def session_id():
    join()
    return _session


def table():
    join()
    return _table


def joined():
    """This process's session if it is a member of it, else None (never
    joins)."""
    return _session


def joined_table():
    """The session table if this process is a member, else None."""
    return _table


def set_up():
    """Gives the native side this user's run directory (at import, before
    any lock is made); remembers why not if there is none."""
    global _no_run_dir
    try:
        _C.set_lock_dir(_paths.run_dir())
    except OSError as exc:
        _no_run_dir = exc


_no_run_dir = None  # the OSError of set_up(), if any


def join(patience=0.0):
    """Connects this process to its session's keeper, starting one if needed.
    Raises SharedMemoryError if it cannot (no keeper answers in time, or
    none can run here); with `patience`, keeps trying a keeper that does not
    answer for that many seconds first (a receiver: a message it cannot load
    would be lost). Once joined, this process stays a member of that
    session: a connection lost later (a keeper that died or did not answer
    in time) is made anew by the next request that needs one."""
    if _session is not None:
        return

    def attempt():
        with _lock:
            if _session is None:
                _join(_config.env_setting(ENV_VAR))

    _patiently(attempt, patience)


def _patiently(attempt, patience):
    """attempt(), tried again while it raises SharedMemoryError(ETIMEDOUT)
    (a keeper that did not answer in time), for `patience` seconds; after a
    timeout a keeper is not asked again for a deadline's length
    (_silent_until): each new try waits for that."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return attempt()
        except _C.SharedMemoryError as exc:
            if exc.errno != errno.ETIMEDOUT or time.monotonic() >= deadline:
                raise
        time.sleep(min(0.1, max(0.0, _silent_until - time.monotonic())))


def _join(session):
    global _connection, _session, _table, _keeper_pid, _silent_until
    if _no_run_dir is not None:
        raise _unavailable(f"it has no directory to work in: {_no_run_dir}")
    if time.monotonic() < _silent_until:
        raise _timed_out("joining its session (it did not answer just before)")
    for last_try in (False, True):
        conn = _connect(session) if session else None
        if conn is None:
            # First process of the tree, or its keeper died: start one, under
            # the same id. Never a new id for a session that has one: that
            # would split its members.
            session = session or secrets.token_hex(6)
            _start_keeper(session)
            conn = _connect_soon(session)
            if conn is None:
                raise _unavailable("its keeper did not start")
        _keeper_pid = _peer_pid(conn)
        try:
            reply, fds = _request(conn, _protocol.join(_C.process_id()))
            break
        except TimeoutError:
            conn.close()
            _silent_until = time.monotonic() + _config.keeper_timeout()
            raise _timed_out("joining its session") from None
        except OSError as exc:
            # It died between our connect and our request (a SIGKILL): once
            # more, which finds its successor or starts one.
            conn.close()
            if last_try:
                raise _unavailable(f"its keeper is gone: {exc}") from None
    try:
        if reply != _protocol.TABLE or len(fds) != 1:
            raise _unavailable(f"its keeper answered {reply[:16]!r} (busy)")
        _table = _C.SessionTable.map(fds[0])
    except BaseException:
        conn.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
    os.environ[ENV_VAR] = session
    _C.set_lock_session(session)
    _session, _connection = session, conn


def _unavailable(why, code=errno.EHOSTDOWN):
    return _C.SharedMemoryError(code, f"torchshm: no session keeper ({why})")


def leave():
    """Closes this process's connection to the keeper (it is exiting). If the
    keeper died meanwhile, removes what dead processes left in the run
    directory: no keeper may be left to (its socket and lock included)."""
    global _connection, _left
    _left = True
    conn, _connection = _connection, None
    if conn is None:
        return
    try:
        keeper_died = _fds.readable(conn, timeout=0)  # EOF
    except OSError:
        keeper_died = False
    conn.close()
    if keeper_died:
        _paths.sweep_orphans(None)


def keeper_pid(session=None):
    """The pid of a session's keeper as this process sees it (0: unknown, or
    in another PID namespace)."""
    if session is None or session == _session:
        return _keeper_pid
    found = _foreign.get(session)
    return found[1] if found else 0


def register_segment(segment):
    """Hands a new segment's fd to the keeper (no reply: the keeper serves
    requests in order, and a fetch waits for registrations queued on other
    connections). Rejoins a keeper that died, once. Raises SharedMemoryError
    if the keeper does not take it in time: then the segment must not be
    used (a message naming it would die with its sender)."""
    message = _protocol.register(segment.index, segment.uid)
    with _lock:
        try:
            socket.send_fds(_connection, [message], [segment.fd])
            return
        except TimeoutError:
            _drop_connection(timed_out=True)
            raise _timed_out("registering a segment") from None
        except (OSError, AttributeError):  # the keeper died, or we left
            pass
        rejoin()  # registers `segment` too: it holds its fd


def _drop_connection(timed_out=False):
    """Closes this process's connection. After a keeper that did not answer
    in time: a late reply must never be read as the answer to the next
    request, and for a deadline's length joining again fails at once rather
    than wait again."""
    global _connection, _silent_until
    conn, _connection = _connection, None
    if conn is not None:
        conn.close()
    if timed_out:
        _silent_until = time.monotonic() + _config.keeper_timeout()


_silent_until = 0.0  # see _drop_connection
_left = False  # leave() was called: this process is exiting


def rejoin():
    """Joins the session's keeper again after it died (a new one, with a new
    table) and registers every segment this process created and still holds
    an fd of."""
    global _unregistered
    with _lock:
        _drop_connection()
        if _left:
            raise _unavailable("this process is exiting")
        _unregistered = True
        _join(_session)
        for segment in _C.segments_with_fd():
            index = _table.claim(segment.uid)
            segment.rebind(_table, index)
            try:
                socket.send_fds(
                    _connection,
                    [_protocol.register(index, segment.uid)],
                    [segment.fd],
                )
            except OSError as exc:
                if segment.fd < 0:
                    continue  # let go of meanwhile (unlinked): nothing to keep
                # Not registered: the next rejoin (check(), within a second;
                # hand_over() at exit) registers them all again, and the
                # keeper ignores repeats. A connection stays open only while
                # the keeper has every segment this process holds an fd of.
                _drop_connection(timed_out=isinstance(exc, TimeoutError))
                return
        _unregistered = False


_unregistered = False  # a rejoin began and did not register every segment


def check():
    """Rejoins if the keeper died (its connection reads as closed). Called
    by the expiry timer when that connection wakes it, and at each of its
    wake-ups (Note [Expiry timer]), and about once a second by the pool's
    thorough pass. Skipped while another thread waits for a reply on the
    connection: False then, else True. Never raises. (At exit, hand_over()
    waits instead.)"""
    if not _lock.acquire(blocking=False):
        return False
    try:
        conn = _connection
        if conn is None:
            if _session is not None and not _left and time.monotonic() >= _silent_until:
                try:
                    rejoin()  # after a keeper that did not answer in time
                except OSError:  # SharedMemoryError, or no keeper could start
                    pass
            return True
        if _closed(conn):
            try:
                rejoin()
            except OSError:  # SharedMemoryError, or no keeper could start
                pass  # the next request tries again (or goes on without)
        return True
    finally:
        _lock.release()


def connection_fd():
    """The fd of this process's connection to its keeper, or None. A member
    is never sent anything unasked, so it reads as ready when the keeper died
    (or when a reply waits for the thread that asked): the expiry timer
    waits on it (Note [Expiry timer])."""
    conn = _connection
    fd = conn.fileno() if conn is not None else -1
    return fd if fd >= 0 else None


def _closed(conn):
    """Whether a member's connection reads as closed: its keeper died (a
    member is never sent anything unasked, so anything to read is EOF)."""
    try:
        return _fds.readable(conn, timeout=0)
    except OSError:
        return True


def hand_over(patience):
    """At exit, before this process's segment fds close: makes sure that a
    live keeper has every segment this process created and holds an fd of
    (what its messages in flight name), rejoining a keeper that died, and
    trying again for `patience` seconds where it cannot (a new keeper slow
    to start, one that did not answer in time, another thread on the
    connection). Returns the monotonic time at which it last saw its keeper
    alive with all of them, or None where it could not. The caller closes
    the fds right after: a keeper that dies later takes their messages with
    it (Note [Segment lifetime]: "lost after every holder died")."""
    deadline = time.monotonic() + patience
    if not _lock.acquire(timeout=patience):
        return None
    try:
        while _session is not None and not _left:
            if _keeper_has_everything():
                return time.monotonic()
            wait = max(0.0, _silent_until - time.monotonic())
            if time.monotonic() + wait >= deadline:
                return None
            time.sleep(wait)
            try:
                rejoin()
            except OSError:  # SharedMemoryError, or no keeper could start
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return None
    finally:
        _lock.release()


def keeper_with_everything():
    """The pid of the live keeper that has every segment this process created
    and holds an fd of, or 0 while none does (it died, and no rejoin has
    finished). Waits for a rejoin under way: keeper_pid() names the new
    keeper as soon as the join is made, before the segments are registered.
    What a test or the soak waits for before it kills a sender."""
    with _lock:
        if _session is None or not _keeper_has_everything():
            return 0
        return _keeper_pid


def _keeper_has_everything():
    """Whether the keeper this process registered its segments with lives
    and has them all: its connection open (not at EOF); or, dropped after
    that keeper did not answer in time (stopped, swamped), still the keeper
    listening on the session's socket, with no rejoin left unfinished."""
    conn = _connection
    if conn is not None:
        return not _closed(conn)
    if _unregistered:
        return False
    probe = _connect(_session)
    if probe is None:
        return False
    try:
        return _peer_pid(probe) == _keeper_pid
    finally:
        probe.close()


def close_released():
    """Has the keeper close, before this returns, every segment that has been
    let go (it does so within a second anyway): torchshm.trim() means now.
    Nothing to do before joining or after leaving."""
    with _lock:
        if _connection is None:
            return
        try:
            _request(_connection, _protocol.request(_protocol.CLOSE_RELEASED))
        except TimeoutError:
            _drop_connection(timed_out=True)  # it closes them when it can
        except OSError:
            pass  # a keeper that died is replaced at the next request


def fetch(session, uid, index, patience=0.0):
    """An fd of segment `uid` of `session`, from its keeper's socket (the
    caller closes it); raises SharedMemoryError(ENOENT) if the keeper has
    none. With `patience`, asks a keeper that does not answer in time again
    for that many seconds first, as join() does. Remembers the table of
    another session, so that this process can flag that session's segments
    as its members do."""
    return _patiently(lambda: _fetch(session, uid, index), patience)


def _fetch(session, uid, index):
    message = _protocol.fetch(index, uid)
    if session == session_id():
        with _lock:
            try:
                reply, fds = _request(_connection, message)
            except TimeoutError:
                _drop_connection(timed_out=True)
                raise _timed_out("fetching a segment") from None
            except (OSError, AttributeError):
                rejoin()
                reply, fds = _request(_connection, message)
    else:
        conn = _connect(session)
        if conn is None:
            raise _gone(session, uid, "its session's keeper is gone")
        try:
            reply, fds = _request(conn, message)
            if len(fds) == 2 and session not in _foreign:
                _foreign[session] = (_C.SessionTable.map(fds[1]), _peer_pid(conn))
        finally:
            conn.close()
    for fd in fds[1:]:
        os.close(fd)
    if reply != _protocol.FOUND or not fds:
        raise _gone(session, uid, "its keeper does not hold it any more")
    return fds[0]


def foreign_table(session):
    found = _foreign.get(session)
    return found[0] if found else None


def status(session=None):
    """The keeper's report on a session (default: this one) as a dict, or
    None if its keeper is gone."""
    import json

    session = session or session_id()
    conn = _connect(session)
    if conn is None:
        return None
    try:
        _, fds = _request(conn, _protocol.request(_protocol.STATUS))
    finally:
        conn.close()
    (fd,) = fds
    try:
        size = os.fstat(fd).st_size
        return json.loads(os.pread(fd, size, 0))
    finally:
        os.close(fd)


def _gone(session, uid, why):
    return _C.SharedMemoryError(
        errno.ENOENT,
        f"torchshm: segment {uid:016x} of session {session} is gone ({why}):"
        " its sender's session ended, or every process holding it let it go",
    )


def _timed_out(doing):
    return _C.SharedMemoryError(
        errno.ETIMEDOUT,
        f"torchshm: the session keeper (pid {_keeper_pid or 'unknown'}) did not"
        f" answer within {_config.keeper_timeout():g} s while {doing}"
        " (TORCHSHM_KEEPER_TIMEOUT)",
    )


def _request(conn, message):
    """Sends one request and returns (reply, fds); TimeoutError past the
    connection's deadline (_connect)."""
    conn.send(message)
    reply, fds, flags, _addr = socket.recv_fds(conn, 64, 2)
    if flags & socket.MSG_CTRUNC:  # fds dropped: this process is at its limit
        for fd in fds:
            os.close(fd)
        _fds.raise_soft_limit()
        raise OSError(errno.EMFILE, "torchshm: the keeper's reply lost its fds")
    if not reply:
        for fd in fds:
            os.close(fd)
        raise ConnectionResetError(errno.ECONNRESET, "the keeper is gone")
    return reply, fds


def _connect(session):
    """A connection to a session's keeper, or None. Only a keeper of this user
    is trusted (its socket is in a directory every user can write)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(_config.keeper_timeout())  # every request's deadline
    try:
        conn.connect(_paths.socket_path(session))
        if _peer_uid(conn) == os.geteuid():
            return conn
    except OSError:
        pass
    conn.close()
    return None


def _connect_soon(session):
    """_connect, retried for a deadline's length: when two members restart a
    session's keeper at once, the one whose keeper lost the session's lock
    connects to the other, which may not listen yet."""
    deadline = time.monotonic() + _config.keeper_timeout()
    while (conn := _connect(session)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return conn


def _peer_uid(conn):
    return _protocol.peer_creds(conn)[1]


def _peer_pid(conn):
    return _protocol.peer_creds(conn)[0]


def _start_keeper(session):
    # A new process session: a Ctrl-C to the foreground group must not kill
    # the keeper before it sweeps.
    linger = _config.session_linger()
    proc = subprocess.Popen(
        _protocol.command(sys.executable, session, _paths.run_dir(), linger),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # One byte once it listens; EOF if it failed (or another keeper serves).
    # A keeper that is that slow to start serves no one and exits.
    _fds.readable(proc.stdout, timeout=max(_config.keeper_timeout(), 5.0))
    proc.stdout.close()
    # The keeper outlives us by design; drop the Popen so Python does not warn
    # that a child is still running when this object is collected.
    proc.returncode = 0


def after_fork_in_child():
    """A forked child is a member of its own: its death must be seen. It keeps
    the inherited table and connects anew (the keeper answers nothing to "j").
    Called by _lifecycle's fork protocol (Note [Fork]), after the child got its
    own process id."""
    global _lock, _connection, _left
    _lock = threading.RLock()
    _left = False
    _foreign.clear()
    inherited, _connection = _connection, None
    if inherited is None:
        return
    inherited.close()  # the parent's, which stays open there
    conn = _connect(_session)
    if conn is None:
        return  # the keeper is gone: the first request rejoins
    try:
        conn.send(_protocol.join(_C.process_id(), table_wanted=False))
    except OSError:
        conn.close()
        return
    _connection = conn

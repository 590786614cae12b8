"""The session keeper: holds an fd of every segment of its session, hands
them out, and closes each one once nothing holds it (Note [Segment lifetime]
in csrc/lifetime/segment.h).

Run by torchshm._lifetime.session as `python -I -S daemon.py SESSION RUN_DIR
LINGER` (protocol.command); it imports only the standard library, so that it
starts in milliseconds. It listens on a Unix socket in the user's run
directory under /dev/shm (paths.run_dir(): reachable from any network
namespace that shares this /dev/shm, and no other user can create a name in
it), holds the session's lock file for
its whole life, and makes the session table (csrc/lifetime/table.h): every process of
the session maps it.

What it does, and what that costs, so that it stays idle whatever is alive:
- A creator registers each new segment (its fd, one message, no reply); the
  keeper keeps the fd at fd_base + index, where any process of this user
  opens it through /proc, or hands it out over the socket.
- Once a second it reads the table's flag bytes (C speed) and looks only at
  flagged segments: one that someone found unheld is closed; the tickets of
  one with messages in flight are judged (a pipe closed everywhere for a
  whole scan, or a writer that died before its write returned).
- When a member's connection closes (a process died or exited), it looks at
  every segment once, shortly after; and, as a safety net for holders of
  other sessions, once a minute or less often (at most 1% of a core).
- When no member is connected, the session lingers while one may still join
  and read its messages: a live process of the session that has not joined
  (its lock file, or TORCHSHM_SESSION in its environment: a `subprocess`
  child that has not imported torchshm yet), or a message in flight on a
  pipe some process still holds open; at most LINGER seconds. Then the
  session's tickets die with it: it closes what no live process holds, waits
  for processes of other sessions to let go of the rest (a handle another
  rank loaded), and exits.
- It never waits on a client: replies are non-blocking (a client that does
  not read its replies is dropped), and an fd kept in reserve lets it answer
  "busy" to a connection it has no fd for. Every fd a request carries that
  it does not keep is closed.
It only ever touches files of its own user, in its run directory, and only
regular files and sockets: never through a link.

Note [The keeper's facts]
~~~~~~~~~~~~~~~~~~~~~~~~~
What the keeper and the library must agree on lives beside this file, once:
where its files are (paths.py), what it reads of a segment and makes of the
session table (layout.py, csrc/lifetime/layout.h restated and held against the native
module by tests/test_layout.py), its command line and the words of its
socket (protocol.py), and what it learns from /proc (procfs.py). The
library imports those; it never imports this file, which it runs. All are
standard library only: run as a script, this file imports them as its
directory's modules; imported as a package (the tests), as the package's.
"""

import errno
import json
import os
import resource
import selectors
import socket
import sys
import time

if __package__:  # imported as torchshm._keeper.daemon (the tests)
    from torchshm._keeper import book, layout, paths, procfs, protocol
else:  # run as `python -I -S daemon.py`, which puts no directory on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import book  # noqa: E402
    import layout  # noqa: E402
    import paths  # noqa: E402
    import procfs  # noqa: E402
    import protocol  # noqa: E402

GRACE_SECONDS = 2.0  # no member connected: one may still be joining
STARTUP_SECONDS = 30.0  # the starter died before it joined
SCAN_SECONDS = 1.0
DEATH_SWEEP_DELAY = 0.2  # coalesces the exits of a whole pool of workers
SLOW_SWEEP_SECONDS = 60.0  # holders of other sessions, missed flags
SWEEP_DUTY = 0.005  # the slow sweep takes at most this share of a core
ORPHAN_SCAN_SECONDS = 10.0
# A connection holds at most a socket buffer of requests (278 of the
# smallest with the default 208 KiB): enough passes to read them all.
DRAIN_PASSES = 1024


class Keeper:
    def __init__(self, session, listener, linger=protocol.DEFAULT_LINGER_SECONDS):
        self.session = session
        self.listener = listener
        self.linger = linger
        # Kept for accept() at the fd limit (see accept).
        self.reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        # When the session began, as far as this keeper knows (clock ticks
        # after boot): its own start, or its oldest member's (a keeper
        # started again). A process older than that cannot carry the
        # session's id or its messages' pipes: one whose /proc it cannot
        # read does not make those unknown (procfs.py).
        self.book = book.SegmentBook(procfs.start_time(os.getpid()))
        self.members = set()  # connections that joined the session
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        now = time.monotonic()
        self.next_scan = now + SCAN_SECONDS
        self.death_sweep_at = None
        self.slow_sweep_at = now + SLOW_SWEEP_SECONDS
        self.next_orphan_scan = now
        self.idle_since = now
        self.idle_limit = STARTUP_SECONDS
        self.starter = os.getppid()
        self.alone_since = now  # no member connected since
        self.draining = False
        self.after_drain = []  # answers to give once the drain is done

    def saw_member(self, conn):
        """Moves the session's birth back to a member's start."""
        pid = _peer_pid(conn)
        started = procfs.start_time(pid) if pid > 0 else None
        if started is not None and self.book.born is not None:
            self.book.born = min(self.book.born, started)

    # ---- requests

    def accept(self):
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return  # accepted already, by a drain since the select
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self.refuse()
            return
        if not _peer_is_us(conn):
            conn.close()
            return
        conn.setblocking(False)  # never wait on a client (reply)
        self.selector.register(conn, selectors.EVENT_READ)

    def refuse(self):
        """At the fd limit: the reserved fd makes room to accept the waiting
        connection and answer "busy", so that it does not wait for ever (its
        process then goes on without torchshm)."""
        os.close(self.reserve)
        try:
            conn, _ = self.listener.accept()
            try:
                conn.setblocking(False)
                conn.send(protocol.BUSY)
            except OSError:
                pass
            conn.close()
        except OSError:
            pass
        finally:
            self.reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def serve(self, conn):
        try:
            data, fds, _flags, _addr = socket.recv_fds(
                conn, protocol.MESSAGE_BYTES, protocol.MAX_FDS
            )
        except BlockingIOError:
            return  # woken for nothing
        except OSError:
            data, fds = b"", []
        kept = None
        try:
            if not data:
                self.drop(conn)
            else:
                kept = self.request(conn, data.decode("ascii").split(), fds)
        except Exception:  # noqa: BLE001 - a bad request must not end the session
            pass
        finally:
            for fd in fds:
                if fd != kept:
                    _close(fd)

    def request(self, conn, words, fds):
        """Serves one request; returns the fd it carried that is kept (the
        caller closes the others)."""
        kind = words[0]
        if kind in (protocol.JOIN, protocol.REJOIN):
            self.members.add(conn)
            self.saw_member(conn)
            if kind == protocol.JOIN:
                self.reply(conn, protocol.TABLE, [self.book.table.fd])
        elif kind == protocol.REGISTER:
            if len(fds) == 1:
                self.book.register_segment(int(words[1]), int(words[2], 16), fds[0])
                return fds[0]
        elif kind == protocol.FETCH:
            uid = int(words[2], 16)
            if uid in self.book.by_uid:
                self.answer_fetch(conn, uid)
            else:  # its registration may be queued on another connection
                self.after_registrations(lambda: self.answer_fetch(conn, uid))
        elif kind == protocol.CLOSE_RELEASED:
            self.book.scan_flags()
            self.reply(conn, protocol.CLOSED)
        elif kind == protocol.STATUS:
            # A report counts what was registered before it.
            self.after_registrations(lambda: self.report(conn))
        return None

    def after_registrations(self, answer):
        """Gives `answer` once every request already waiting has been read
        (drain): at once after a drain of its own, or, read during another's
        drain, when that one is done."""
        if self.draining:
            self.after_drain.append(answer)
        else:
            self.drain()
            answer()

    def answer_fetch(self, conn, uid):
        entry = self.book.by_uid.get(uid)
        if entry is None:
            self.reply(conn, protocol.NOT_FOUND)
        else:
            self.reply(conn, protocol.FOUND, [entry.fd, self.book.table.fd])

    def report(self, conn):
        fd = os.memfd_create("torchshm:status", os.MFD_CLOEXEC)
        try:
            os.write(fd, json.dumps(self.status()).encode())
            self.reply(conn, protocol.REPORT, [fd])
        finally:
            os.close(fd)

    def reply(self, conn, data, fds=()):
        """Sends without waiting: a client whose replies pile up unread (or
        that is gone) is dropped."""
        try:
            socket.send_fds(conn, [data], list(fds))
        except OSError:
            self.drop(conn)

    def drain(self):
        """Serves every request waiting on any connection, without blocking,
        before a question whose answer depends on them (a fetch, a report):
        a process may register many segments, send a message naming the
        last and exit before the keeper reads the first. Each pass serves one
        request per ready connection and accepts new ones; waiting requests
        are bounded by the sockets' buffers, and DRAIN_PASSES bounds a client
        that keeps sending. Not recursive: a fetch or a report read meanwhile
        is answered once the drain is done (after_drain), when what was
        registered before it has been read too."""
        self.draining = True
        try:
            for _ in range(DRAIN_PASSES):
                if not self.serve_ready(0):
                    break
        finally:
            self.draining = False
            answers, self.after_drain = self.after_drain, []
            for answer in answers:
                try:
                    answer()
                except Exception:  # noqa: BLE001 - as in serve()
                    pass

    def serve_ready(self, timeout):
        """Serves one request on each ready connection; returns how many
        connections (the listener included) were ready."""
        ready = self.selector.select(timeout=timeout)
        for key, _ in ready:
            if key.fileobj is self.listener:
                self.accept()
            else:
                self.serve(key.fileobj)
        return len(ready)

    def drop(self, conn):
        try:
            self.selector.unregister(conn)
        except KeyError:
            return  # dropped already
        conn.close()
        if conn in self.members:
            self.members.discard(conn)
            # A member exited or died: look at everything, once, shortly.
            if self.death_sweep_at is None:
                self.death_sweep_at = time.monotonic() + DEATH_SWEEP_DELAY
            if not self.members:
                now = time.monotonic()
                self.idle_since, self.idle_limit = now, GRACE_SECONDS
                self.alone_since = now

    def status(self):
        segments = []
        for entry in self.book.by_uid.values():
            header = layout.read_header(entry.fd)
            if header is None:
                continue
            try:
                used = os.fstat(entry.fd).st_blocks * 512
            except OSError:
                used = 0
            segments.append(
                {
                    "uid": f"{entry.uid:016x}",
                    "index": entry.index,
                    "capacity": header.capacity,
                    "bytes": used,
                    "creator": f"{header.creator:016x}",
                    "generation": header.generation,
                    "pinned": bool(header.pinned),
                    "unlinked": bool(header.unlinked),
                    "holders": [
                        f"{w:016x}"
                        for _, w, _, _, _ in header.slots
                        if not w & layout.TICKET_BIT
                    ],
                    "tickets": sum(1 for s in header.slots if s[1] & layout.TICKET_BIT),
                }
            )
        return {
            "session": self.session,
            "pid": os.getpid(),
            "members": len(self.members),
            "table_capacity": self.book.table.capacity,
            "segments": segments,
        }

    # ---- the loop

    def session_lives(self):
        """Whether the session has a member, or a live process whose lock file
        names it (a member that has not joined this keeper yet)."""
        if self.members:
            return True
        me = f" {self.session}"
        for name in paths.lock_files():
            if name.startswith(f"{paths.PREFIX}session-"):
                continue
            path = os.path.join(paths.run_dir(), name)
            try:
                fd = paths.open_own_file(path)
            except OSError:
                return True  # cannot tell (out of fds): the session lives
            if fd is None:
                continue
            try:
                text = os.pread(fd, 128, 0).decode("ascii", "replace").strip()
                if text.endswith(me) and paths.held(fd):
                    return True
            finally:
                os.close(fd)
        return False

    def may_still_be_read(self, now):
        """Whether, with no member left, the session's messages may still be
        read, for at most `linger` seconds: a process of the session that has
        not joined yet started with its id in its environment, or a message in
        flight is on a pipe some process still holds open."""
        if now - self.alone_since >= self.linger:
            return False
        if procfs.session_in_environment(self.session, self.book.born):
            return True
        channels = set()
        for entry in self.book.by_uid.values():
            header = layout.read_header(entry.fd)
            if header is None:
                continue
            channels.update(
                channel
                for _i, word, channel, _writer, verdict in header.slots
                if word & layout.TICKET_BIT
                and channel
                and verdict != layout.ticket_id(word)
            )
        if not channels:
            return False
        pipes = procfs.open_pipes(self.book.born)
        return pipes is None or not channels.isdisjoint(pipes)

    def run(self):
        """Serves until the session is over and nothing of it is held."""
        while True:
            self.serve_session()
            if self.wind_down():
                return

    def serve_session(self):
        """Returns once no member is connected and no process of the session
        lives."""
        while True:
            now = time.monotonic()
            if self.idle_limit == STARTUP_SECONDS and os.getppid() != self.starter:
                self.idle_limit = GRACE_SECONDS  # the starter died before joining
            if not self.members and now - self.idle_since >= self.idle_limit:
                if not (self.session_lives() or self.may_still_be_read(now)):
                    return
                self.idle_since, self.idle_limit = now, SCAN_SECONDS
            self.serve_ready(SCAN_SECONDS)
            now = time.monotonic()
            if now >= self.next_scan:
                self.next_scan = now + SCAN_SECONDS
                self.book.scan_flags()
            if self.death_sweep_at is not None and now >= self.death_sweep_at:
                self.death_sweep_at = None
                self.book.sweep()
            if now >= self.slow_sweep_at:
                started = time.monotonic()
                self.book.sweep()
                self.book.forget_unregistered(now)
                took = time.monotonic() - started
                self.slow_sweep_at = now + max(SLOW_SWEEP_SECONDS, took / SWEEP_DUTY)
            if now >= self.next_orphan_scan:
                self.next_orphan_scan = now + ORPHAN_SCAN_SECONDS
                paths.sweep_orphans(self.session)

    def wind_down(self):
        """The session is over and its tickets with it: closes what no live
        process holds. Segments that processes of other sessions still hold
        (a handle another rank loaded) stay loadable until those let go or
        die. False if a process joined meanwhile (the session goes on)."""
        while self.book.sweep(tickets_alive=False):
            deadline = time.monotonic() + SCAN_SECONDS
            while (left := deadline - time.monotonic()) > 0:
                self.serve_ready(left)
                if self.members:
                    self.idle_since = time.monotonic()
                    return False
        return True


def _close(fd):
    try:
        os.close(fd)
    except OSError:
        pass


def _peer_is_us(conn):
    """Only processes of this user may join, register or fetch."""
    return protocol.peer_creds(conn)[1] == os.geteuid()


def _peer_pid(conn):
    return protocol.peer_creds(conn)[0]


def _raise_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def listen(session):
    """The session's listening socket, under its lock; None if another keeper
    serves the session (or the names are not ours to use)."""
    lock = paths.lock_session(session)
    if lock is None:
        return None, None
    path = paths.socket_path(session)
    paths.remove_socket(path)  # a dead keeper's: we hold the session's lock
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # Never waits in accept: a drain (Keeper.drain) can accept the connection
    # that a select it runs inside saw, and that select's caller then
    # accepts on a stale "ready".
    listener.setblocking(False)
    try:
        listener.bind(path)  # only we can enter paths.run_dir(): no chmod needed
        listener.listen(128)
    except OSError:
        listener.close()
        os.close(lock)
        return None, None
    return listener, lock


def serve(session, ready, linger=protocol.DEFAULT_LINGER_SECONDS):
    _raise_fd_limit()
    listener, lock = listen(session)
    if listener is None:
        return  # another keeper serves this session (EOF tells the starter)
    keeper = Keeper(session, listener, linger)
    ready.write(b"1")
    ready.close()
    try:
        keeper.run()
    finally:
        paths.remove_socket(paths.socket_path(session))
        try:
            os.unlink(paths.session_lock_path(session))
        except OSError:
            pass
        os.close(lock)
        # What processes of the session killed since the last scan left (and
        # any other dead session's socket): no keeper may be left to do it.
        paths.sweep_orphans(session)


def main():
    session, directory, linger = sys.argv[1], sys.argv[2], float(sys.argv[3])
    ready = os.fdopen(1, "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 2)
    if not paths.is_run_dir(directory):
        return  # EOF tells the starter
    paths.use_run_dir(directory)  # the starter's choice: the same rule, made once
    serve(session, ready, linger)
    # stdout was the ready pipe; point it somewhere harmless once closed.
    os.dup2(devnull, 1)


if __name__ == "__main__":
    main()

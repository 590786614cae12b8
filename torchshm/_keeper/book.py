"""The keeper's book of its session's segments: the fd it keeps of each,
and whether anything still holds one (Note [Segment lifetime] in
csrc/lifetime/segment.h). The keeper's request loop (daemon.py) writes in it
as members register segments, and has it look at them: the table's flagged
segments every scan, every segment after a member's death. Standard library
only (Note [The keeper's facts] in daemon.py)."""

import fcntl
import os

if __package__:  # the keeper's module imported by the tests
    from torchshm._keeper import layout, paths, procfs
else:  # the keeper's: daemon.py put its directory on sys.path
    import layout
    import paths
    import procfs

UNREGISTERED_SECONDS = 60.0  # an index claimed by a creator that died


class Entry:
    __slots__ = ("uid", "index", "fd", "creator")

    def __init__(self, uid, index, fd, creator):
        self.uid, self.index, self.fd, self.creator = uid, index, fd, creator


class SegmentBook:
    def __init__(self, born):
        self.table = layout.Table(*layout.table_capacity())
        self.by_uid = {}  # uid -> Entry
        self.by_index = {}  # index -> uid
        # Tickets judged at the last scan: (uid, slot, word) -> (channel,
        # writer); and those whose pipe was closed or writer dead then.
        self.seen = {}
        self.suspects = set()
        self.unregistered = {}  # index -> (uid, first seen) claimed, unknown
        # When the session began (Keeper.saw_member moves it back): what
        # procfs.open_pipes may ignore.
        self.born = born

    def register_segment(self, index, uid, fd):
        if uid in self.by_uid or not layout.is_segment_fd(fd, uid):
            os.close(fd)
            return
        target = self.table.fd_base + index
        if 0 <= index < self.table.capacity and not _fd_in_use(target):
            os.dup2(fd, target, inheritable=False)
            os.close(fd)
            fd = target
        header = layout.read_header(fd, with_slots=False)
        self.by_uid[uid] = Entry(uid, index, fd, header.creator if header else 0)
        self.by_index[index] = uid
        self.unregistered.pop(index, None)

    def close(self, entry):
        """Stops handing the segment out: marks it unlinked (a process holding
        a cached mapping then knows) and closes the keeper's fd."""
        layout.mark_unlinked(entry.fd)
        os.close(entry.fd)
        del self.by_uid[entry.uid]
        if self.by_index.get(entry.index) == entry.uid:
            del self.by_index[entry.index]
        self.table.free(entry.index, entry.uid)
        for key in [k for k in self.seen if k[0] == entry.uid]:
            del self.seen[key]

    def held(self, header, tickets_alive, alive):
        """Whether a live holder names the segment. `alive` memoizes process
        liveness within one pass."""
        if header.unlinked:
            return False
        if header.pinned and tickets_alive:
            return True  # kept until the session ends (Note [Segment lifetime])
        for _index, word, _channel, _writer, verdict in header.slots:
            if word & layout.TICKET_BIT:
                if tickets_alive and verdict != layout.ticket_id(word):
                    return True
            else:
                if word not in alive:
                    alive[word] = paths.process_alive(word)
                if alive[word]:
                    return True
        return False

    def sweep(self, tickets_alive=True):
        """Looks at every segment; closes those no live holder names."""
        alive = {}
        for entry in list(self.by_uid.values()):
            header = layout.read_header(entry.fd)
            if header is None or not self.held(header, tickets_alive, alive):
                self.close_if_unheld(entry, tickets_alive, alive)
        return len(self.by_uid)

    def close_if_unheld(self, entry, tickets_alive, alive):
        """Closes a segment found unheld, after reading its header once more.
        One read can be torn: a holder that sends it on puts the message's
        ticket in a lower slot, then lets go of its own slot, and a read
        that copies the lower slot before the ticket and the higher one after
        the release sees neither. The ticket stays, so a second read sees it
        (the message in flight), unless no holder was left."""
        header = layout.read_header(entry.fd)
        if header is not None and self.held(header, tickets_alive, alive):
            return
        self.close(entry)

    def forget_unregistered(self, now):
        """Frees indices claimed by creators that died before registering."""
        for index in range(self.table.capacity):
            uid = self.table.uids[index]
            if not uid or index in self.by_index:
                self.unregistered.pop(index, None)
                continue
            first = self.unregistered.setdefault(index, (uid, now))
            if first[0] != uid:
                self.unregistered[index] = (uid, now)
            elif now - first[1] >= UNREGISTERED_SECONDS:
                self.table.free(index, uid)
                del self.unregistered[index]

    def scan_flags(self):
        """Looks at the segments the table flags: closes the unheld, judges
        the tickets of messages in flight."""
        tickets, headers = {}, {}
        for index, bits in self.table.flagged():
            self.table.clear_flag(index)  # before looking (csrc/lifetime/table.h)
            uid = self.by_index.get(index)
            if uid is None:
                # Claimed, but its registration not read yet: it may wait on
                # a connection not even accepted. Look again next scan, until
                # it comes or forget_unregistered frees the index.
                if self.table.uids[index]:
                    self.table.set_flag(index, bits)
                continue
            entry = self.by_uid[uid]
            header = layout.read_header(entry.fd)
            if header is None:
                continue
            headers[uid] = (entry, header)
            # A ticket being written is judged by its writer, whose pipe may
            # not be named yet (it is, just before the write: csrc/send/message.h);
            # a written one by its pipe, if it has one.
            mine = {
                (uid, i, word): (channel, writer)
                for i, word, channel, writer, verdict in header.slots
                if word & layout.TICKET_BIT
                and (channel or word & layout.WRITING_BIT)
                and verdict != layout.ticket_id(word)
            }
            if mine:
                self.table.set_flag(index, layout.FLAG_TICKETS)  # look again
                tickets.update(mine)
        self.judge(tickets, headers)
        alive = {}
        for entry, header in headers.values():
            if entry.uid in self.by_uid and not self.held(header, True, alive):
                self.close_if_unheld(entry, True, alive)

    def judge(self, tickets, headers):
        """Writes a verdict on each ticket seen at two scans in a row whose
        pipe was closed in every process of this user both times, or whose
        writer died before its write returned, both times (csrc/lifetime/segment.h)."""
        waiting = {k: v for k, v in tickets.items() if self.seen.get(k) == v}
        self.seen = tickets
        dead = set()
        if waiting:
            pipes = procfs.open_pipes(self.born)
            for key, (channel, writer) in waiting.items():
                writing = key[2] & layout.WRITING_BIT
                if (channel and pipes is not None and channel not in pipes) or (
                    writing and not paths.process_alive(writer)
                ):
                    dead.add(key)
        for uid, slot, word in dead & self.suspects:
            entry, header = headers[uid]
            layout.write_verdict(entry.fd, slot, layout.ticket_id(word))
            # The header read before the verdict must see it too.
            header.slots = [
                s[:4] + (layout.ticket_id(word),)
                if s[0] == slot and s[1] == word
                else s
                for s in header.slots
            ]
        self.suspects = dead


def _fd_in_use(fd):
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
        return True
    except OSError:
        return False

"""The lifetime wing: how shared memory lives and dies (Note [Segment
lifetime] in csrc/lifetime/segment.h). A process joins its session (session), makes
and pools segments (segments, pool, holdings), maps what it receives
(attach, mappings), gives idle memory back (expiry), and survives fork and
exit (lifecycle); the session's keeper is a program of its own
(torchshm/_keeper/)."""

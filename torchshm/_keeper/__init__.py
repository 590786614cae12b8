"""The session keeper, a program of its own (daemon.py: its request loop,
and book.py: its segments; standard library only, run as `python -I -S
daemon.py`), and the facts it shares with the library: where its files are
(paths), what it reads of a segment and the session table (layout), and the
words of its socket (protocol). The library imports those, never the
daemon."""

"""The differential fuzzer: random programs that send NumPy arrays between
processes, each run with torchshm and with TORCHSHM_DISABLE=1 (torchshm
imported, not registered: arrays pickled byte by byte), which must observe
the same bytes.

    .venv/bin/python -m scripts.fuzz --minutes 1          # make fuzz (CI)
    .venv/bin/python -m scripts.fuzz --replay SEED        # one program again
    .venv/bin/python -m scripts.fuzz --program FILE.json  # a shrunk one

The rule under test: a plain send (pickled by multiprocessing, without
share()) delivers the bytes as they were at the send, and nothing written
afterwards, by any process, reaches the receiver; a share() result is one
memory that every holder writes. Every receiver records each array it gets
at arrival and again after every later step (ops.record); the two runs'
logs must be the same, no process may end in a way the program did not plan,
hang, or leave anything behind (a keeper, files in /dev/shm, processes).

The modules, by concern: grammar (the step kinds, and which programs mean
one thing), draw (a program from a seed, Note [Episodes]), ops (what a step
does to arrays, in the program's processes), interpreter (the conductor and
the actors of one run), zygote (the fork server the runs start from, torch
imported once), runner (both runs of a program, compared and judged),
leftovers, shrink (delta debugging) and __main__ (the command line). The
fuzzer's own process never imports torchshm (it would be a session too).

What it was built to find (the bugs of commit 34166a2): a born array sent,
then written by a fork child or parent of the sender; slab blocks (born
arrays below 64 KiB) reused after a send (a DataLoader worker's refilled
buffer, a Pool worker's); a born array share()d to one receiver and sent
plainly to another; a libc fork child that drops a received array, exits
by sys.exit or sends (SIGSEGV); a spawn child whose atexit handler sends
(hang).
"""

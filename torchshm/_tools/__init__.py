"""Tools for people: `python -m torchshm` (report) and its diagnosis of
what stops torchshm here (doctor)."""

"""`python -m torchshm [--json] [--no-check]`: the diagnostic report for bug
reports (torchshm/_diagnostics.py); `python -m torchshm doctor` and
`python -m torchshm ls` (torchshm/_doctor.py)."""

import sys

from torchshm._diagnostics import main

if __name__ == "__main__":
    sys.exit(main())

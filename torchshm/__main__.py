"""`python -m torchshm [--json] [--no-check]`: the diagnostic report for bug
reports (see torchshm/_diagnostics.py)."""

import sys

from torchshm._diagnostics import main

if __name__ == "__main__":
    sys.exit(main())

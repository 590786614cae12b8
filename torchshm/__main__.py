"""`python -m torchshm [--json] [--no-check]`: the diagnostic report for bug
reports (torchshm/_tools/report.py); `python -m torchshm doctor` and
`python -m torchshm ls` (torchshm/_tools/doctor.py)."""

import sys

from torchshm._tools.report import main

if __name__ == "__main__":
    sys.exit(main())

"""torchshm's version: the one place it is written (pyproject.toml reads it
from here, so the package metadata and torchshm.__version__ agree)."""

__version__ = "0.1.0"

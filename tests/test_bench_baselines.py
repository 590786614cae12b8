"""torch's own path in `make bench` is torch's alone: its fresh interpreter
never imports torchshm, whose reducers would otherwise carry torch's batches
and make the baseline torchshm itself (scenario 17 measured torchshm against
torchshm so, until its children ran the scenario's file, not its module)."""

import pytest

from benchmarks.scenarios import dataloader_scale

# the same on every stack: the pip lane only (Note [What each lane
# runs] in tests/conftest.py).
pytestmark = [pytest.mark.multiprocess, pytest.mark.any_stack]


@pytest.mark.parametrize("method", dataloader_scale.TORCH_ALONE)
def test_torch_alone_runs_without_torchshm(method):
    figures = dataloader_scale.measure(method, workers=1, samples=64, epochs=1)
    assert figures["torchshm_imported"] is False
    assert len(figures["seconds"]) == 2


def test_the_probe_sees_torchshm_where_a_method_imports_it():
    figures = dataloader_scale.measure("torchshm_collate", 1, samples=64, epochs=1)
    assert figures["torchshm_imported"] is True

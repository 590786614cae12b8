"""A child whose target returns while a non-daemon thread it started still
works: multiprocessing runs the exit finalizers before it joins the threads,
and torchshm's exit must wait for them (Note [Exit after the threads] in
torchshm/_lifetime/lifecycle.py). Before it did, a thread's received 4 MiB
array changed under it (the memory went back to its sender's pool), and a
thread's sends slept for ever: nothing delivered, a child that never
exited.

Each case runs under torchshm here, with arrays and tensors, and as the
control with arrays under plain multiprocessing (TORCHSHM_DISABLE=1, a fresh
interpreter), which must give the same outcome (torch's own sharing is no
control: thread_exit_children.control says why)."""

import json
import os

import pytest

from tests import thread_exit_children as cases
from tests.conftest import START_METHODS, run_python

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("kind", cases.KINDS)
@pytest.mark.parametrize("case", cases.CASES)
def test_a_thread_that_outlives_its_target_keeps_what_it_holds_and_sends(
    ctx, case, kind
):
    method = ctx.get_start_method()
    assert cases.run_case(method, case, kind) == cases.expected(case)


@pytest.mark.parametrize("method", START_METHODS)
def test_the_control_gives_the_same_outcomes_without_torchshm(method):
    env = dict(os.environ, TORCHSHM_DISABLE="1")
    env.pop("TORCHSHM_SESSION", None)
    run = run_python(
        "import sys; from tests.thread_exit_children import control;"
        " control(sys.argv[1])",
        method,
        env=env,
        timeout=10 * cases.TIMEOUT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    outcomes = json.loads(run.stdout)
    assert outcomes == {case: cases.expected(case) for case in cases.CASES}

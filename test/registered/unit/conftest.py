"""Fixtures shared by the unit tests of several packages: single-rank parallel scopes."""

import pytest
import torch

from sglite.srt.distributed.bootstrap import destroy_parallel_runtime, init_parallel_runtime
from sglite.srt.runtime_context import ParallelState, scoped


@pytest.fixture()
def rank0():
    """A tp_size=1 parallel scope on one CPU thread; whatever runtime the test starts in it is torn down."""
    torch.set_num_threads(1)
    with scoped(parallel=ParallelState(tp_size=1)):
        try:
            yield
        finally:
            destroy_parallel_runtime()


@pytest.fixture()
def one_rank():
    """A tp_size=1 parallel scope with the parallel runtime already initialised (gloo, one CPU thread)."""
    torch.set_num_threads(1)
    state = ParallelState(tp_size=1)
    with scoped(parallel=state):
        init_parallel_runtime(state, 0, 1, None, "gloo")
        try:
            yield state
        finally:
            destroy_parallel_runtime()

"""Shared fixture for the benchmark scripts' tests: the script a test module names, loaded as a module."""

from pathlib import Path

import pytest

from sglite.testing.scripts import load_script

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def bench(request):
    """The benchmark script named by the test module's ``SCRIPT`` (e.g. ``"bench_peers"``), as a module."""
    return load_script(REPO / "benchmark" / f"{request.module.SCRIPT}.py")

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # worker modules must be importable in spawned workers

import tempfile

#: the autopilot's calibration cache of this test run, apart from the user's (~/.cache) and from other runs: a test
#: must not find what an earlier run measured. Spawned workers inherit it.
os.environ["GRADCOMPRESS_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="gradcompress-test-cache-"), "calibration.json")

import pytest


@pytest.fixture
def lib():
    """The fast kernels on (skipped where they cannot be built)."""
    from gradcompress.codecs import fast

    if not fast.kernels_available():
        pytest.skip(f"fast kernels unavailable: {fast.failure()}")
    with fast.use(True):
        yield

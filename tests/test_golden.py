"""Bit-for-bit golden results (recorded on main before the exchange redesign, see tests/golden_workers.py).

A refactor must leave every digest unchanged. A change that alters results on purpose (e.g. a new noise generator
of the stochastic codecs) re-records the affected digests in a commit of its own that says so:
``python tests/golden_workers.py > tests/golden.json``.

Float results depend on the CPU's vector width (reduction order in torch's and our kernels), so the digests are kept
per ``torch.backends.cpu.get_cpu_capability()``: ``golden.json`` (AVX512, where they were first recorded) and
``golden-AVX2.json`` (recorded on an AVX2 machine from e64906d, the landed main whose results matched
``golden.json`` on AVX512, before the HSDP work). On a CPU class with no recorded file the comparison is skipped, saying so.
Cases added since a class's file was recorded (int2, chunked top-k: recorded on AVX2 only) are compared where
recorded and named in a warning elsewhere.
"""

import json
import os
import warnings

import pytest

import golden_workers

import torch

HERE = os.path.dirname(__file__)
CAPABILITY = torch.backends.cpu.get_cpu_capability()
GOLDEN = os.path.join(HERE, "golden.json" if CAPABILITY == "AVX512" else f"golden-{CAPABILITY}.json")


@pytest.fixture(scope="module")
def digests():
    return golden_workers.record()


def test_golden_cases_cover_every_codec():
    from gradcompress import available

    specs = {spec.split(":")[0] for _, spec, _ in golden_workers.CODEC_CASES}
    assert specs == set(available())


@pytest.mark.parametrize("world", [2, 4])
def test_results_are_bit_for_bit_the_recorded_ones(digests, world):
    if not os.path.exists(GOLDEN):
        pytest.skip(f"no golden digests recorded for this CPU class ({CAPABILITY}): record them from a commit "
                    f"known good with python tests/golden_workers.py > {os.path.relpath(GOLDEN, HERE)}")
    with open(GOLDEN) as f:
        expected = {k: v for k, v in json.load(f).items() if k.startswith(f"W{world}/")}
    got = {k: v for k, v in digests.items() if k.startswith(f"W{world}/")}
    assert set(expected) <= set(got), f"recorded cases no longer run: {sorted(set(expected) - set(got))}"
    unrecorded = sorted(set(got) - set(expected))
    if unrecorded:  # cases added on another CPU class: their digests for this one are still to be recorded
        warnings.warn(f"golden: no {CAPABILITY} digests for {', '.join(unrecorded)}; record them on such a machine")
    if CAPABILITY == "AVX2":  # the class this suite's cases were last recorded on: every case must be there
        assert not unrecorded, unrecorded
    changed = sorted(k for k in expected if got[k] != expected[k])
    assert not changed, f"results changed for: {', '.join(changed)}"

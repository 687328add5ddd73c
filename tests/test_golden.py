"""Bit-for-bit golden results (see tests/golden_workers.py): a refactor must leave every digest unchanged.

Float results depend on more than the CPU's vector width (two AVX512 machines, one Intel and one AMD, gave different
digests from the same commit: MKL dispatches by vendor), so recorded digests are kept per machine fingerprint
(``golden_workers.fingerprint()``: CPU vendor, model and flags, torch's version, vector width and BLAS) in
``tests/golden/<id>.json``. Where this machine's fingerprint was recorded, every recorded case must give the same
digest. Elsewhere the guard still holds, within a stated tolerance: every case's mass (the sum of the absolute
values of what it digests) must lie within ``golden_workers.MASS_RTOL`` of a recording's — a change of results
moves it far more than another BLAS does. Record from a commit known good with
``python tests/golden_workers.py --record``. Beside them, ``golden_portable`` digests what no BLAS or vector width
moves (every codec's exchange and committed state on exact inputs) and is compared bit for bit on every machine; a change that alters results on purpose re-records the affected
digests in a commit of its own that says so.
"""

import os
import warnings

import pytest

import golden_portable
import golden_workers

FINGERPRINT = golden_workers.fingerprint()
RECORDED = golden_workers.recorded_for(FINGERPRINT)


def test_golden_cases_cover_every_codec():
    from gradcompress import available

    specs = {spec.split(":")[0] for _, spec, _ in golden_workers.CODEC_CASES}
    assert specs == set(available())


def test_a_fingerprint_names_its_own_recording_only():
    other = dict(FINGERPRINT, vendor="AuthenticAMD" if FINGERPRINT["vendor"] != "AuthenticAMD" else "GenuineIntel")
    assert golden_workers.fingerprint_id(other) != golden_workers.fingerprint_id(FINGERPRINT)
    assert golden_workers.recorded_for(other) is None


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_results_are_the_recorded_ones(world):
    """Bit for bit where this machine was recorded; elsewhere every case's mass within MASS_RTOL of a recording's
    (never skipped)."""
    got = golden_workers.record_world(world)
    if RECORDED is None:
        path, masses = golden_workers.recorded_masses()
        expected = {k: v for k, v in masses.items() if k.startswith(f"W{world}/")}
        assert expected and set(expected) <= set(got["masses"]), sorted(set(expected) - set(got["masses"]))
        moved = {k: (got["masses"][k], v) for k, v in expected.items()
                 if got["masses"][k] != pytest.approx(v, rel=golden_workers.MASS_RTOL)}
        assert not moved, f"results moved beyond {golden_workers.MASS_RTOL} of {os.path.basename(path)}: {moved}"
        return
    path, recorded = RECORDED
    expected = {k: v for k, v in recorded.items() if k.startswith(f"W{world}/")}
    assert set(expected) <= set(got["digests"]), f"recorded cases no longer run: {sorted(set(expected) - set(got['digests']))}"
    unrecorded = sorted(set(got["digests"]) - set(expected))
    if unrecorded:
        warnings.warn(f"golden: {os.path.basename(path)} has no digests for {', '.join(unrecorded)}; re-record",
                      stacklevel=2)
    changed = sorted(k for k in expected if got["digests"][k] != expected[k])
    assert not changed, f"results changed for: {', '.join(changed)}"


def test_portable_results_are_the_same_on_every_machine():
    """What does not depend on the BLAS or the vector width (every codec's exchange and committed state on exact
    inputs, ``golden_portable``) is compared bit for bit on every machine; the codecs that reduce in float in
    ``golden_portable.NOT_PORTABLE`` only."""
    expected = golden_portable.recorded()
    got = golden_portable.digests()
    assert set(expected) == set(got) - set(golden_portable.NOT_PORTABLE), sorted(set(expected) ^ set(got))
    changed = sorted(k for k in expected if got[k] != expected[k])
    assert not changed, f"results changed for: {', '.join(changed)}"


def test_the_portable_cases_cover_every_codec_case_but_the_reasons_given():
    assert set(golden_portable.NOT_PORTABLE) < {name for name, _, _ in golden_workers.CODEC_CASES}
    assert all(golden_portable.NOT_PORTABLE.values())

"""Streaming DiLoCo (``DiLoCo(..., fragments=F, delay=tau, mix=a)``) on gloo groups of real processes.

``fragments=1, delay=0`` is today's DiLoCo bit for bit: tests/test_golden.py's DiLoCo digests (recorded before
streaming existed) run through the same code. Here: the schedule (every parameter once per H steps), bytes per
sync, agreement of the replicas, the first fragment's update against unfragmented DiLoCo, a slow worker (no
deadlock, the others wait only at apply steps), an Inf in one fragment, and resume with a fragment in flight.
"""

from __future__ import annotations

import pytest
import torch

import streaming_workers as sw
from gradcompress.optim import DiLoCo, streaming
from gradcompress.testbed import launch

TIMEOUT = 120


def test_every_parameter_is_sent_once_per_h_steps():
    for fragments, h in ((1, 5), (4, 8), (3, 10), (4, 6)):
        for f in range(fragments):
            sends = [t for t in range(1, 10 * h + 1) if streaming.due(t, f, fragments, h)]
            assert sends[0] == h + streaming.offset(f, fragments, h)
            assert all(b - a == h for a, b in zip(sends, sends[1:]))
    layers = [[0, 1], [2, 3], [4], [5, 6], [7]]
    parts = streaming.fragments_of(layers, 2)
    assert parts == [[0, 1, 4, 7], [2, 3, 5, 6]]
    assert sorted(i for p in parts for i in p) == list(range(8))


def test_the_schedule_says_when_to_send_and_apply_which_fragment():
    """streaming.Schedule, DiLoCo's part: the sends of due(), a send's apply step, and the quorum's position taken at
    the apply (a replica that counted fewer steps than its peers counts as they do, once)."""
    s = streaming.Schedule(8, 4, 1, None, [[0], [1, 2], [3], [4]])
    assert (s.fragments, s.delay, s.mix, s.parts) == (4, 1, 0.5, [[0], [1, 2], [3], [4]])
    sends = {t: s.sends(t) for t in range(1, 25) if s.sends(t)}
    assert sends == {8: [0], 10: [1], 12: [2], 14: [3], 16: [0], 18: [1], 20: [2], 22: [3], 24: [0]}
    for _ in range(10):
        s.tick()
    apply_at = s.sent(10)
    assert apply_at == 11 and s.position() == 10
    flight = {1: streaming.InFlight(1, [], apply_at, streaming.done(True))}
    assert s.applies(flight, 10) == [] and s.applies(flight, 11) == [1]
    assert s.tick() == 11
    s.agree(12)  # the quorum's first member sent at its step 12, two steps after this replica
    s.applied(apply_at)
    assert s.steps == 13
    s.applied(apply_at)  # nothing agreed since: the count stays
    assert s.steps == 13


def test_bad_streaming_options_are_one_clear_error():
    model = sw.square_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for kw, needle in (({"fragments": 5}, "fragments=5 is more than the model's layers: the model has 4 layers"),
                       ({"fragments": 0}, "fragments"),
                       ({"delay": 8}, "delay must be an integer from 0 to sync_every - 1 (7)"),
                       ({"delay": 2, "mix": 0.0}, "mix must be a number in (0, 1]")):
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            DiLoCo(model, inner, sync_every=8, **kw)


@pytest.mark.parametrize("delay", [0, 3])
def test_fragments_sync_in_turn_and_the_replicas_agree(delay):
    (log, stats, sync_bytes, sizes), _ = launch.run(sw.schedule, 2, "int8", 4, delay, timeout=TIMEOUT)
    h, applied = 8, {}
    for row in log:
        assert row["agree"], row  # every rank's anchors, and each fragment just applied, are the same
        for f in row["applied"]:
            applied.setdefault(f, []).append(row["step"])
    for f in range(4):  # applied delay steps after each send, every H steps
        assert applied[f] == [h + 2 * f + delay + k * h for k in range(len(applied[f]))], (f, applied[f])
    # bytes: the four fragments are equal (four equal layers), each a quarter of an unfragmented sync (int8: but
    # for the per-512 scales at the ends of the fragments' buckets)
    (_, whole, whole_bytes, _), _ = launch.run(sw.schedule, 2, "int8", 1, 0, 16, timeout=TIMEOUT)
    assert len(set(sync_bytes)) == 1 and abs(4 * sync_bytes[0] - whole_bytes[0]) <= 4 * 4
    assert stats["fragments"] == 4 and stats["delay"] == delay and stats["peak_sync_bytes"] == sync_bytes[0]


def test_dense_fragment_bytes_are_exactly_a_quarter():
    (_, parted, parted_bytes, sizes), _ = launch.run(sw.schedule, 2, "none", 4, 0, 15, timeout=TIMEOUT)
    (_, whole, whole_bytes, _), _ = launch.run(sw.schedule, 2, "none", 1, 0, 15, timeout=TIMEOUT)
    assert sizes == [2, 2, 2, 2] and len(set(parted_bytes)) == 1
    assert 4 * parted["peak_sync_bytes"] == whole["peak_sync_bytes"] == whole_bytes[0]
    assert parted["wire_bytes"] == whole["wire_bytes"]  # one cycle (steps 8, 10, 12, 14 against 8): the same bytes


def test_first_fragment_update_is_unfragmented_diloco_restricted():
    """codec none, plain SGD inside, delay 0: fragment 0's update at step H is unfragmented DiLoCo's update
    restricted to fragment 0 (bit for bit); the other fragments have not moved from the start."""
    (parted, parts), _ = launch.run(sw.first_fragment_update, 2, 4, timeout=TIMEOUT)
    (whole, _), _ = launch.run(sw.first_fragment_update, 2, 1, timeout=TIMEOUT)
    start = list(sw.square_model().parameters())
    for i in parts[0]:
        assert torch.equal(parted[i], whole[i]), i
    for f in range(1, 4):
        for i in parts[f]:
            assert torch.equal(parted[i], start[i].detach()), i


def test_a_slow_worker_makes_the_others_wait_only_at_apply_steps():
    """Rank 1 starts only once rank 0 has run every step before its first apply step alone (sends included); rank 0
    then waits for rank 1 at the apply steps (its wait is counted there)."""
    (fast, _, fast_stats), (slow, alone, _) = launch.run(sw.slow_worker, 2, timeout=TIMEOUT)
    assert fast_stats["syncs"] == 4 and fast_stats["skipped"] == 0
    assert alone  # rank 0's ordinary steps and sends never waited for rank 1
    assert [step for step, applied in fast if applied][0] == 8 + 3  # the first apply step: the one it waited at
    assert fast_stats["wait_seconds"] > 0  # and it waited there: rank 1 had not sent yet


def test_inf_in_one_fragment_skips_that_fragment_everywhere():
    for skipped, unchanged, finite, agree, syncs in launch.run(sw.inf_in_one_fragment, 2, timeout=TIMEOUT):
        assert skipped == 1 and all(unchanged) and finite and agree
        assert syncs == 5  # fragments 0, 1, 2 (skipped), 3 at steps 8, 10, 12, 14, and 0 again at 16


def test_resume_with_a_fragment_in_flight_is_exact(tmp_path):
    """The exchange in flight at the save completes before the save; its average is saved with its apply step
    and applied there after the load: the resumed run equals the uninterrupted one bit for bit."""
    for in_flight, same in launch.run(sw.resume, 2, str(tmp_path / "ck"), timeout=TIMEOUT):
        assert in_flight == [0] and same

"""SparseLoCo outer gradients for DiLoCo (outer="sparseloco"), the 2-bit value codec (int2) and chunked top-k.

Pure tests first (codecs, scheme grammar, argument errors, single process), then gloo workers (each launch with a
timeout so that a deadlock fails instead of hanging).
"""

import pytest
import torch

import sparseloco_workers as sw
from gradcompress import make
from gradcompress.testbed import launch
from gradcompress.codecs.sparse import chunk_counts
from gradcompress.optim import DiLoCo
from gradcompress.optim.diloco import SPARSELOCO_CODEC, SPARSELOCO_ERROR_DECAY, SPARSELOCO_OUTER_LR
from gradcompress.scheme import parse_scheme

pytestmark = pytest.mark.slow  # multi-process runs: outside the fast lane (pytest -m "not slow")

TIMEOUT = 120


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- int2
@pytest.mark.parametrize("bucket", [512, 7])
def test_int2_is_a_two_level_sign_magnitude_quantiser_and_a_contraction(bucket):
    c = make(f"int2:bucket={bucket}")
    x = randn(3000, seed=1) * torch.linspace(0.01, 5, 3000)
    y = c.decode(c.encode(x))
    n = x.numel()
    assert torch.equal(torch.sign(y)[x != 0], torch.sign(x)[x != 0])
    err, total, levels_energy = 0.0, 0.0, 0.0
    for lo in range(0, n, bucket):
        xb, yb = x[lo : lo + bucket].double(), y[lo : lo + bucket].double()
        mags = set(yb.abs().tolist())
        assert len(mags) <= 2  # two levels per bucket
        high = xb.abs() >= xb.abs().mean()
        for group in (high, ~high):  # each group keeps its sum of magnitudes
            if group.any():
                assert torch.allclose(yb.abs()[group].sum(), xb.abs()[group].sum(), rtol=1e-5)
        err += float(((xb - yb) ** 2).sum())
        total += float((xb**2).sum())
        levels_energy += float((yb**2).sum())
    assert err == pytest.approx(total - levels_energy, rel=1e-4)  # ||x - Q(x)||^2 = ||x||^2 - sum n_g c_g^2
    assert err < total
    assert c.encode(x).nbytes == c.payload_nbytes(n) == (2 * n + 7) // 8 + 8 * -(-n // bucket)


def test_int2_marks_a_non_finite_bucket_non_finite():
    c = make("int2:bucket=4")
    x = torch.tensor([1.0, -2.0, float("inf"), 0.5, 3.0, -1.0, 0.25, 2.0])
    y = c.decode(c.encode(x))
    assert not torch.isfinite(y[:4]).any() and torch.isfinite(y[4:]).all()


# --------------------------------------------------------------------------- chunked top-k
@pytest.mark.parametrize("n, chunk, ratio", [(4096 * 3, 4096, 1 / 64), (1000, 256, 0.05), (100, 300, 0.1)])
def test_chunked_topk_keeps_each_chunks_largest_and_sends_packed_offsets(n, chunk, ratio):
    c = make(f"topk:ratio={ratio},chunk={chunk}")
    x = randn(n, seed=2)
    p = c.encode(x)
    y = c.decode(p)
    per, last, k = chunk_counts(ratio, chunk, n)
    for j, lo in enumerate(range(0, n, chunk)):
        xs, ys = x[lo : lo + chunk], y[lo : lo + chunk]
        want = per if lo + chunk <= n else last
        keep = xs.abs().topk(want).indices
        ref = torch.zeros_like(xs)
        ref[keep] = xs[keep]
        assert torch.equal(ys, ref), j
    bits = (chunk - 1).bit_length()
    offsets = (k * bits + 7) // 8 if bits <= 8 else k + (k * (bits - 8) + 7) // 8
    assert p.nbytes == c.payload_nbytes(n) == 4 * k + offsets


def test_sparseloco_default_codec_sends_under_two_bytes_per_kept_value():
    c = make(SPARSELOCO_CODEC)
    n = 4096 * 64
    k = chunk_counts(c.ratio, c.chunk, n)[2]
    assert k == n // 64  # 1.5625 %
    assert c.payload_nbytes(n) == k // 4 + 8 * -(-k // 512) + k + k // 2  # 2-bit values, levels, 12-bit offsets
    assert c.payload_nbytes(n) / k < 1.8


# --------------------------------------------------------------------------- scheme and arguments
def test_scheme_option_outer_next_to_diloco():
    from gradcompress.cli.task import RunConfig

    s = parse_scheme("none:diloco=50,outer=sparseloco")
    assert s.diloco == 50 and s.outer == "sparseloco"
    assert s.canonical() == "none:diloco=50,outer=sparseloco"
    assert parse_scheme("int4:diloco=25").outer is None
    cfg = RunConfig(scheme="none:diloco=50,outer=sparseloco", task="lm")
    assert cfg.diloco_options() == {"codec": None, "outer": "sparseloco"}  # exact codec: SparseLoCo's own
    cfg = RunConfig(scheme="topk:ratio=0.03,values=int2,diloco=50,outer=sparseloco", task="lm")
    assert cfg.diloco_options()["codec"].spec == "topk:values=int2,ratio=0.03"
    assert RunConfig(scheme="int4:diloco=25").diloco_options()["outer"] == "nesterov"
    with pytest.raises(ValueError, match=r"outer must be one of nesterov, sparseloco .*got 'adam'"):
        parse_scheme("none:diloco=50,outer=adam")
    with pytest.raises(ValueError, match="give it with diloco=H"):
        parse_scheme("int4:outer=sparseloco")
    s = parse_scheme("none:diloco=50,outer=sparseloco,outer_lr=2")
    assert s.outer_lr == 2.0 and s.canonical() == "none:diloco=50,outer=sparseloco,outer_lr=2.0"
    assert RunConfig(scheme=s.text, task="lm").diloco_options()["outer_lr"] == 2.0
    with pytest.raises(ValueError, match=r"outer_lr must be a number > 0 .*got 0"):
        parse_scheme("none:diloco=50,outer_lr=0")
    with pytest.raises(ValueError, match="outer_lr is DiLoCo's outer learning rate; give it with diloco=H"):
        parse_scheme("int4:outer_lr=1")


@pytest.mark.parametrize("kwargs, match", [
    ({"outer": "adam"}, r"outer must be one of nesterov, sparseloco, got 'adam'"),
    ({"outer": None}, r"outer must be one of nesterov, sparseloco, got None"),
    ({"outer": "sparseloco", "codec": "none"}, r"codec 'none' is exact"),
    ({"outer": "sparseloco", "error_decay": 1.5}, r"error_decay must be a number in \[0, 1\], got 1.5"),
    ({"error_decay": 0.9}, r"error_decay applies to outer='sparseloco' only"),
    ({"outer": "sparseloco", "error_feedback": False}, r"error_feedback=False does not apply"),
    ({"outer": "sparseloco", "codec": "topk:error_feedback=false"}, r"error_feedback=False does not apply"),
    ({"outer": "sparseloco", "topology": 2}, r"runs on the flat topology"),
    ({"outer": "sparseloco", "outer_optimizer": lambda ps: torch.optim.Adam(ps)}, r"outer_optimizer applies"),
])
def test_bad_outer_arguments_are_refused(kwargs, match):
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match=match):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, **kwargs)


def test_sparseloco_defaults_and_nesterov_unchanged():
    with launch.one_process_group():
        _sparseloco_defaults_and_nesterov_unchanged()


def _sparseloco_defaults_and_nesterov_unchanged():
    model = torch.nn.Linear(64, 32)
    sl = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, outer="sparseloco")
    assert sl.compressor.codec.spec == make(SPARSELOCO_CODEC).spec
    assert sl.compressor.error_feedback and sl.compressor.min_numel == 0
    assert sl.error_decay == SPARSELOCO_ERROR_DECAY
    group = sl.outer.param_groups[0]
    assert group["lr"] == SPARSELOCO_OUTER_LR and group["momentum"] == 0  # no outer momentum
    dl = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    assert dl.outer_kind == "nesterov" and dl.compressor.codec.spec == "none"
    group = dl.outer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True)
    assert "outer_kind" not in dl.state_dict()  # the nesterov checkpoint stays as it was


def _single_process_run(**kwargs):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    torch.manual_seed(0)
    for p in model.parameters():
        p.data.copy_(torch.randn_like(p))
    opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=3, **kwargs)
    g = torch.Generator().manual_seed(3)
    for _ in range(9):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


def test_explicit_nesterov_is_the_default_bit_for_bit():
    with launch.one_process_group():
        _explicit_nesterov_is_the_default_bit_for_bit()


def _explicit_nesterov_is_the_default_bit_for_bit():
    a, _ = _single_process_run()
    b, _ = _single_process_run(outer="nesterov", codec="none")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c, opt = _single_process_run(outer="sparseloco", codec="topk:ratio=0.05,values=int2")
    assert opt.stats()["syncs"] == 3 and not all(torch.equal(x, y) for x, y in zip(a, c))


# --------------------------------------------------------------------------- on gloo workers
@pytest.mark.parametrize("world, decay", [(2, 1.0), (4, 0.95)])
def test_error_feedback_invariant_and_replicas_over_syncs(world, decay):
    for records, invariant, scale, numels, stats in launch.run(sw.invariants, world, decay, timeout=TIMEOUT):
        assert stats["syncs"] == len(records) == 4 and stats["skipped"] == 0
        c = make(sw.CODEC)
        for r in records:
            assert r["finite"] and r["replicas_equal"] and r["params_are_anchor"]
            # e <- decay e + delta; e <- e - delivered: delivered is this rank's own encode of e
            assert r["own_encode_err"] < 1e-6, r
            assert all(0 < kept <= chunk_counts(c.ratio, c.chunk, n)[2] for kept, n in zip(r["kept"], numels))
            # the anchor moves by outer_lr times the mean of the workers' deliveries, nothing else (no momentum)
            assert r["moved"] > 0 and r["mean_vs_anchor_move"] < 1e-6 * max(1.0, r["moved"]), r
        # sum of decayed deliveries + residual = sum of decayed outer gradients
        assert invariant < 1e-5 * max(1.0, scale), (invariant, scale)
        per_sync = (world - 1) * sum(c.payload_nbytes(n) for n in numels)  # all-gather; no dense small tensors
        assert stats["wire_bytes"] == 4 * per_sync


def test_resume_mid_interval_is_bit_exact(tmp_path):
    for full, resumed, stats, mismatch in launch.run(sw.resume, 2, str(tmp_path / "ck"), timeout=TIMEOUT):
        assert all(torch.equal(a, b) for a, b in zip(full, resumed))
        assert stats["syncs"] == 2 and stats["steps"] == 8
        assert "saved with outer='sparseloco'" in mismatch

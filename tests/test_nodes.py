"""The topology-aware exchange (issue 21) on real gloo processes, nodes simulated with an explicit ``topology=``:
2 nodes x 2 workers and 2 nodes x 3, ``"auto"`` on one node of 4 processes (flat) and from torchrun's variables.

Every launch has a timeout: a deadlock fails the test instead of hanging CI.
"""

import math

import pytest
import torch

import gradcompress
import nodes_workers as nw
from gradcompress import topology
from gradcompress.testbed import launch
from gradcompress.collectives import LocalCollectives
from gradcompress.exchanges.layout import chunk_numel, fills_buckets

pytestmark = pytest.mark.slow  # multi-process runs: outside the fast lane (pytest -m "not slow")

TIMEOUT = 600
STEPS = 6
CASES = [("none", "none", {}), ("int8 noef", "int8", {"error_feedback": False}),
         ("int4 noef", "int4", {"error_feedback": False}), ("int8", "int8", {}), ("topk", "topk:ratio=0.1", {})]


def _with(per_node, cases):
    return [(name, spec, {"topology": per_node, **opts}) for name, spec, opts in cases]


FOUR = _with(2, CASES) + [("none flat", "none", {"topology": "flat"}), ("int8 flat", "int8", {"topology": "flat"}),
                          ("int8 auto", "int8", {}), ("int8 torchrun", "int8", {"torchrun": 2}),
                          ("int8 bf16", "int8", {"topology": 2, "intra_node": "bf16"})]


@pytest.fixture(scope="module", params=[(4, 2), (6, 3)], ids=["2x2", "2x3"])
def nodes(request):
    world, per_node = request.param
    cases = FOUR if world == 4 else _with(per_node, CASES)
    return world, per_node, launch.run(nw.run_cases, world, cases, STEPS, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def misc():
    return launch.run(nw.misc, 4, 2, timeout=TIMEOUT)


def _inputs(world, step, i):
    return [nw.grad(r, step, i) for r in range(world)]


def _node_means(world, per_node, step, i):
    xs = _inputs(world, step, i)
    return [sum(xs[n * per_node:(n + 1) * per_node]) / per_node for n in range(world // per_node)]


def _mean(world, step, i):
    return sum(_inputs(world, step, i)) / world


def test_none_hierarchical_equals_a_dense_all_reduce(nodes):
    """Within float32 reassociation (the node sums first, then between nodes): rtol 1e-5, atol 1e-6."""
    world, per_node, results = nodes
    for rank in range(world):
        got = results[rank]["none"]
        assert got["stats"]["topology"] == {"nodes": world // per_node, "workers_per_node": per_node,
                                            "kind": "hierarchical"}
        for step in range(STEPS):
            for i in range(len(nw.SHAPES)):
                assert torch.allclose(got["grads"][step][i], _mean(world, step, i), rtol=1e-5, atol=1e-6), (step, i)
                if "none flat" in results[rank]:
                    flat = results[rank]["none flat"]["grads"][step][i]
                    assert torch.allclose(got["grads"][step][i], flat, rtol=1e-5, atol=1e-6), (step, i)


@pytest.mark.parametrize("name,qmax", [("int8 noef", 127), ("int4 noef", 7)])
def test_quantisers_within_their_bound_of_the_node_means(nodes, name, qmax):
    """Two roundings to nearest (each node's mean, then the owner's re-encode of the average), each at most half a
    step of a scale <= the largest |node mean| / qmax (the re-encode's <= (1 + 1/(2 qmax)) of it)."""
    world, per_node, results = nodes
    for step in range(STEPS):
        for i in range(2):  # the compressed tensors (the bias travels dense: exact)
            top = max(float(m.abs().max()) for m in _node_means(world, per_node, step, i))
            bound = (top + top * (1 + 1 / (2 * qmax))) / (2 * qmax) * (1 + 1e-5)
            err = (results[0][name]["grads"][step][i] - _mean(world, step, i)).abs().max()
            assert 0 < err <= bound, (step, i, float(err), bound)
        assert torch.allclose(results[0][name]["grads"][step][2], _mean(world, step, 2), rtol=1e-5, atol=1e-6)


def _residual(results, world, per_node, name, i):
    """Each node's residual of tensor i (its workers' pieces back to back), the mean over nodes."""
    n = math.prod(nw.SHAPES[i])
    per = -(-n // per_node)
    nodes = []
    for node in range(world // per_node):
        pieces = []
        for j in range(per_node):
            state = results[node * per_node + j][name]["states"][-1]["residual"]
            piece = state.get(f"{i}:{j}/{per_node}", torch.zeros(per))
            assert piece.numel() == per  # the residual is this worker's 1/G piece
            pieces.append(piece.reshape(-1))
        nodes.append(torch.cat(pieces)[:n].view(nw.SHAPES[i]))
    return sum(nodes) / len(nodes)


def test_error_feedback_invariant_over_many_steps(nodes):
    """top-k (gathered, no re-encode): sum of results + the nodes' mean residual = sum of the global means."""
    world, per_node, results = nodes
    for i in range(len(nw.SHAPES)):
        delivered = sum(results[0]["topk"]["grads"][step][i] for step in range(STEPS))
        inputs = sum(_mean(world, step, i) for step in range(STEPS))
        residual = _residual(results, world, per_node, "topk", i)
        assert torch.allclose(delivered + residual, inputs, rtol=1e-5, atol=1e-5), i
        if i < 2:
            assert float(residual.abs().max()) > 0.1  # something was held back


def test_replicas_equal_after_every_step(nodes):
    world, _, results = nodes
    for name, got in results[0].items():
        assert all(got["committed"]), name
        for rank in range(1, world):
            for step in range(STEPS):
                assert all(torch.equal(a, b) for a, b in zip(got["grads"][step], results[rank][name]["grads"][step])), \
                    (name, rank, step)


def _expected_bytes(codec, world, per_node):
    """(inter, intra) bytes per step of the hierarchical exchange of nw.SHAPES, float32, from the payloads' sizes
    and the ring formulas (an int8 case: the pieces of the two large tensors through the two-step reduce)."""
    nodes = world // per_node
    per = [-(-math.prod(s) // per_node) for s in nw.SHAPES]
    small = [p for p, s in zip(per, nw.SHAPES) if math.prod(s) < nw.MIN_NUMEL]
    big = [p for p, s in zip(per, nw.SHAPES) if math.prod(s) >= nw.MIN_NUMEL]
    inter = 2 * (nodes - 1) * (sum(small) + 1) * 4 // nodes  # the dense batch and the flag
    whole = [p for p in big if fills_buckets(p, codec.bucket)]
    buckets = sum(-(-p // codec.bucket) for p in whole)
    chunk = codec.wire_nbytes(-(-buckets // nodes) * codec.bucket) if whole else 0
    chunk += sum(codec.wire_nbytes(chunk_numel(p, nodes, 8)) for p in big if p not in whole)
    inter += 2 * (nodes - 1) * chunk
    block = sum(per)
    intra = (per_node - 1) * block * 4 + (per_node - 1) * (block + 1) * 4  # reduce-scatter + all-gather
    return inter, intra


def test_inter_node_bytes_equal_the_payload_arithmetic(nodes):
    world, per_node, results = nodes
    inter, intra = _expected_bytes(gradcompress.make("int8"), world, per_node)
    for rank in range(world):
        stats = results[rank]["int8"]["stats"]
        assert stats["inter_node_bytes"] == STEPS * inter, rank
        assert stats["intra_node_bytes"] == STEPS * intra, rank
        assert stats["wire_bytes"] == stats["inter_node_bytes"] + stats["intra_node_bytes"]
        if "int8 bf16" in results[rank]:  # 16-bit inside the node: half the intra-node bytes, the same between
            bf16 = results[rank]["int8 bf16"]["stats"]
            assert bf16["intra_node_bytes"] * 2 == STEPS * intra and bf16["inter_node_bytes"] == STEPS * inter
    if world == 4:  # flat int8 on the same 4 workers sends every payload over the group: 3x these inter bytes
        flat = results[0]["int8 flat"]["stats"]
        assert flat["inter_node_bytes"] == flat["wire_bytes"] > 2.9 * STEPS * inter


def _assert_same_grads(a_steps, b_steps) -> None:
    """Every step's gradients bit for bit the same."""
    for a, b in zip(a_steps, b_steps):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_auto_on_one_node_stays_flat_bit_for_bit(nodes):
    world, _, results = nodes
    if world != 4:
        pytest.skip("run on the 4-process launch")
    for rank in range(world):
        auto, flat = results[rank]["int8 auto"], results[rank]["int8 flat"]
        assert auto["stats"]["topology"] == {"nodes": 1, "workers_per_node": 4, "kind": "flat"}
        assert auto["stats"]["intra_node_bytes"] == auto["stats"]["wire_bytes"] == flat["stats"]["wire_bytes"]
        assert auto["stats"]["inter_node_bytes"] == 0
        _assert_same_grads(auto["grads"], flat["grads"])
        assert "topology" not in auto["states"][-1]  # a flat state is today's, key for key


def test_auto_from_torchrun_variables_goes_hierarchical(nodes):
    world, _, results = nodes
    if world != 4:
        pytest.skip("run on the 4-process launch")
    for rank in range(world):
        env, explicit = results[rank]["int8 torchrun"], results[rank]["int8"]
        assert env["stats"]["topology"] == {"nodes": 2, "workers_per_node": 2, "kind": "hierarchical"}
        _assert_same_grads(env["grads"], explicit["grads"])


@pytest.mark.parametrize("spec", ["int8", "randomk:ratio=0.1"])
def test_an_inf_on_one_worker_of_one_node_is_non_finite_everywhere(misc, spec):
    for rank, out in enumerate(misc):
        got = out["poisoned"][spec]
        assert got["committed"] == [True, False, True], rank
        assert all(not bool(torch.isfinite(g).all()) for g in got["grads"][1]), rank
        assert all(bool(torch.isfinite(g).all()) for g in got["grads"][2]), rank
        before, after = got["states"][0], got["states"][1]
        assert before["step"] == after["step"] == 1
        for slot in ("residual", "momentum"):
            assert before[slot].keys() == after[slot].keys() and before[slot], (rank, slot)
            assert all(torch.equal(before[slot][k], after[slot][k]) for k in before[slot]), (rank, slot)


def _assert_resumed(results) -> None:
    """Each rank's resumed run (nodes_workers.resumed) equals the straight one bit for bit; a flat load refused."""
    for rank, out in enumerate(results):
        got = out["resumed"]
        assert got["saved_topology"] == "2x2 intra_node=none"
        for a, b in zip(got["rest"]["grads"], got["straight"]["grads"][2:]):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), rank
        assert "saved with topology '2x2 intra_node=none'" in got["refused"] and "'flat'" in got["refused"]


def test_resume_bit_for_bit_with_the_same_topology(misc):
    _assert_resumed(misc)


def test_refusals_name_the_reason(misc):
    for out in misc:
        assert out["powersgd"] is None  # runs hierarchical (whole tensors owned by local ranks)
        assert "topology=3 (workers per node) does not divide the group's 4 workers" in out["indivisible"]


def test_options_are_checked_at_construction():
    for bad in ("mesh", 0, True, 2.0):
        with pytest.raises(ValueError, match="topology must be 'auto', 'flat', an integer >= 1"):
            gradcompress.Compressor("int8", topology=bad)
    with pytest.raises(ValueError, match="intra_node must be one of none, bf16, fp16"):
        gradcompress.Compressor("int8", intra_node="int8")
    assert gradcompress.Compressor("int8:topology=2,intra_node=bf16").topology == 2


def test_unequal_nodes_are_named():
    with pytest.raises(ValueError, match=r"node 'host=a': 3 workers \(ranks 0, 1, 3\); node 'host=b': 1 workers"):
        topology.members_of(["host=a", "host=a", "host=b", "host=a"])
    assert topology.members_of(["host=b", "host=a", "host=b", "host=a"]) == [[0, 2], [1, 3]]


def test_local_reduce_scatter_and_single_process_stats():
    comm = LocalCollectives(2)
    out, work = comm.reduce_scatter(torch.arange(6.0))
    work.wait()
    assert torch.equal(out, torch.tensor([0.0, 2.0, 4.0]))
    comp = gradcompress.Compressor("int8")
    p = torch.nn.Parameter(torch.zeros(2000))
    p.grad = torch.randn(2000)
    comp.synchronize([p], collectives=LocalCollectives(1))
    stats = comp.stats()
    assert stats["topology"] == {"nodes": None, "workers_per_node": None, "kind": "flat"}
    assert stats["inter_node_bytes"] == stats["intra_node_bytes"] == stats["wire_bytes"] == 0


@pytest.mark.parametrize("spec", ["int8", "powersgd:rank=2"])
def test_ddp_hook_goes_hierarchical_with_buckets_and_warm_up(spec):
    """register_ddp_hook(..., topology=2): replicas equal; the same results as synchronize() (state is keyed by
    tensor pieces, or for PowerSGD by whole tensors with owners kept across DDP's bucket rebuild, not by buckets;
    rtol 1e-4 as for the flat exchange's bucket independence)."""
    results = launch.run(nw.ddp_hierarchical, 4, 2, spec, 3, timeout=TIMEOUT)
    for rank in range(4):
        hook, sync = results[rank]["hook"], results[rank]["sync"]
        assert hook["stats"]["topology"]["kind"] == "hierarchical" and hook["stats"]["inter_node_bytes"] > 0
        assert all(torch.equal(a, b) for a, b in zip(hook["params"], results[0]["hook"]["params"])), rank
        for step in range(3):
            assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(hook["grads"][step],
                                                                                  sync["grads"][step])), step


# ---------------------------------------------------------------- PowerSGD: whole tensors owned by local ranks
@pytest.fixture(scope="module")
def power():
    return launch.run(nw.powersgd, 4, 2, STEPS, timeout=TIMEOUT)


def _power_mean(step, i, low_rank):
    return sum(nw.power_grad(r, step, i, low_rank) for r in range(4)) / 4


def test_owners_balance_whole_tensors_by_size():
    from gradcompress.exchanges.owners import owners

    assert owners([math.prod(s) for s in nw.POWER_SHAPES], 2) == [0, 1, 1, 0]
    assert owners([5, 5, 5], 2) == [0, 1, 0]
    assert owners([1, 9], 3) == [1, 0]
    assert owners([5, 5, 5], 2, [None, 0, None]) == [1, 0, 0]  # known owners stay, the others balance around them


def test_powersgd_hierarchical_replicas_equal_after_every_step(power):
    for name in ("random", "low rank", "alternate", "poisoned"):
        ref = power[0][name]
        for rank in range(1, 4):
            for step, grads in enumerate(power[rank][name]["grads"]):
                if not ref["committed"][step]:
                    continue  # the poisoned step: NaN everywhere (test_powersgd_an_inf_rolls_back_everywhere)
                assert all(torch.equal(a, b) for a, b in zip(grads, ref["grads"][step])), (name, rank, step)
    for rank in range(4):
        assert power[rank]["random"]["stats"]["topology"]["kind"] == "hierarchical"
        assert all(power[rank]["random"]["committed"]) and all(power[rank]["alternate"]["committed"])


def test_powersgd_hierarchical_is_exact_on_a_low_rank_average(power):
    """Every worker's matrix lies in a fixed rank-2 span, so the average of the node means has rank <= 2 and
    PowerSGD (rank 2) returns it up to float32 rounding; the random case is visibly lossy (the test can fail)."""
    for step in range(STEPS):
        for i in range(len(nw.POWER_SHAPES)):
            got = power[0]["low rank"]["grads"][step][i]
            assert torch.allclose(got, _power_mean(step, i, True), rtol=1e-4, atol=1e-5), (step, i)
    lossy = power[0]["random"]["grads"][0][0] - _power_mean(0, 0, False)
    assert float(lossy.abs().max()) > 0.1


def test_powersgd_error_feedback_on_the_owners_whole_tensor(power):
    """Residuals are whole tensors on their owner only; sum of results + the nodes' mean residual = sum of the
    global means, over all steps."""
    owner = {0: 0, 1: 1}  # local rank owning matrix i (test_owners_balance_whole_tensors_by_size)
    for i, j in owner.items():
        shape = nw.POWER_SHAPES[i]
        residuals = []
        for node in range(2):
            for local in range(2):
                state = power[2 * node + local]["random"]["states"][-1]["residual"]
                assert (str(i) in state) == (local == j), (i, node, local)
            residuals.append(power[2 * node + j]["random"]["states"][-1]["residual"][str(i)].view(shape))
        delivered = sum(power[0]["random"]["grads"][s][i] for s in range(STEPS))
        inputs = sum(_power_mean(s, i, False) for s in range(STEPS))
        assert torch.allclose(delivered + sum(residuals) / 2, inputs, rtol=1e-4, atol=1e-4), i
        assert float(residuals[0].abs().max()) > 0.1


def test_powersgd_an_inf_rolls_back_everywhere(power):
    for rank in range(4):
        got = power[rank]["poisoned"]
        assert got["committed"] == [True, False, True], rank
        assert all(not bool(torch.isfinite(g).all()) for g in got["grads"][1]), rank
        assert all(bool(torch.isfinite(g).all()) for g in got["grads"][2]), rank
        before, after = got["states"][0], got["states"][1]
        assert before["step"] == after["step"] == 1
        for slot in ("residual", "q", "momentum"):
            assert before[slot].keys() == after[slot].keys() and before[slot], (rank, slot)
            assert all(torch.equal(before[slot][k], after[slot][k]) for k in before[slot]), (rank, slot)


def test_powersgd_inter_node_bytes_are_the_owners_factors(power):
    """Each owner all-reduces its matrices' factors (n + m) x r and its dense tensors plus one flag between the 2
    nodes (2 (N-1)/N = 1 x their bytes); inside the node a reduce-scatter and an all-gather of the largest block
    (3280 elements: 2000 + 1280). The node's uplink carries < 0.4 of flat PowerSGD's."""
    r = nw.POWER_RANK
    own = {0: (48 + 64) * r + 10 + 1, 1: (40 + 32) * r + 2000 + 1}
    for rank in range(4):
        stats = power[rank]["random"]["stats"]
        assert stats["inter_node_bytes"] == STEPS * 4 * own[rank % 2], rank
        assert stats["intra_node_bytes"] == STEPS * 4 * (3280 + 3281), rank
    hier = sum(power[rank]["random"]["stats"]["inter_node_bytes"] for rank in (0, 1))
    flat = sum(power[rank]["flat"]["stats"]["inter_node_bytes"] for rank in (0, 1))
    assert hier < 0.4 * flat, (hier, flat)


def test_powersgd_resume_bit_for_bit_with_the_same_topology(power):
    _assert_resumed(power)


# ---------------------------------------------------------------- CompressedAdam / OneBitAdam with topology=
ADAM_CASES = [("onebit", None, 2), ("onebit flat", None, "flat"), ("int8", "int8", 2), ("int8 flat", "int8", "flat"),
              ("powersgd", "powersgd:rank=2", 2)]
ADAM_WARMUP, ADAM_TOTAL, ADAM_CUT = 2, 7, 4


@pytest.fixture(scope="module")
def adam():
    return launch.run(nw.adam_nodes, 4, ADAM_CASES, ADAM_WARMUP, ADAM_TOTAL, ADAM_CUT, timeout=TIMEOUT)


def test_adam_hierarchical_replicas_equal_and_moved(adam):
    for name, _, topo in ADAM_CASES:
        for rank in range(4):
            got = adam[rank][name]
            assert torch.equal(got["params"], adam[0][name]["params"]), (name, rank)
            assert got["stats"]["topology"]["kind"] == ("flat" if topo == "flat" else "hierarchical"), name
            assert got["stats"]["skipped"] == 0, name
    import onebit_workers as ow

    start = ow.flat(ow.make_model())
    assert float((adam[0]["onebit"]["params"] - start).abs().max()) > 1e-3


def test_adam_hierarchical_sends_fewer_bytes_between_nodes(adam):
    """On compressed steps each node's uplink (the sum over its 2 workers) carries < 0.4 of the flat exchange's
    (flat: every worker's payload to 3 others; hierarchical: each worker's 1/2 piece to 1 other); warm-up steps
    are the same dense all-reduce."""
    for name in ("onebit", "int8"):
        hier = [adam[0][name]["inter"][s] + adam[1][name]["inter"][s] for s in range(ADAM_TOTAL)]
        flat = [adam[0][name + " flat"]["inter"][s] + adam[1][name + " flat"]["inter"][s] for s in range(ADAM_TOTAL)]
        assert hier[:ADAM_WARMUP] == flat[:ADAM_WARMUP], name
        for s in range(ADAM_WARMUP, ADAM_TOTAL):
            assert 0 < hier[s] < 0.4 * flat[s], (name, s, hier[s], flat[s])


def test_adam_residuals_are_this_ranks_piece_in_the_optimizer_state(adam):
    """The first weight (256 x 64 = 16384 elements): worker_error is this rank's 8192-element piece, server_error
    its chunk of the piece between the 2 nodes; flat: the whole parameter and a quarter chunk; PowerSGD whole."""
    from gradcompress.exchanges.layout import chunk_numel

    for rank in range(4):
        assert adam[rank]["onebit"]["worker_error"] == (8192,)
        assert adam[rank]["onebit"]["server_error"] == (chunk_numel(8192, 2),)
        assert adam[rank]["onebit flat"]["worker_error"] == (256, 64)
        assert adam[rank]["onebit flat"]["server_error"] == (chunk_numel(16384, 4),)
        assert adam[rank]["powersgd"]["worker_error"] == (256, 64)


def test_adam_resume_bit_for_bit_with_the_same_topology(adam):
    for name, _, _ in ADAM_CASES:
        for rank in range(4):
            assert torch.equal(adam[rank][name]["resumed"], adam[rank][name]["params"]), (name, rank)


def test_adam_checkpoint_of_another_topology_restarts_the_residuals_with_a_warning(adam):
    for rank in range(4):
        caught = adam[rank]["mismatch"]
        assert any("a worker residual of shape (8192,) does not fit this layout's (256, 64)" in w
                   and "it and the server residual restart at zero" in w for w in caught), caught


# ---------------------------------------------------------------- DiLoCo between nodes, DDP inside
DILOCO_SYNCS, DILOCO_EVERY = 3, 3


@pytest.fixture(scope="module")
def diloco():
    return launch.run(nw.diloco_ddp, 4, 2, ["none", "int8"], DILOCO_SYNCS, DILOCO_EVERY, timeout=TIMEOUT)


def test_diloco_with_ddp_inside_2_nodes_x_2_workers(diloco):
    """Replicas equal inside a node after each inner step (DDP), different between nodes before a sync (their
    data differ), equal everywhere after each sync."""
    for codec in ("none", "int8"):
        for node in range(2):
            a, b = diloco[2 * node][codec], diloco[2 * node + 1][codec]
            for step in range(DILOCO_SYNCS * DILOCO_EVERY):
                assert torch.equal(a["steps"][step], b["steps"][step]), (codec, node, step)
        for s in range(DILOCO_SYNCS):
            assert not torch.equal(diloco[0][codec]["before"][s], diloco[2][codec]["before"][s]), (codec, s)
            for rank in range(4):
                assert diloco[rank][codec]["committed"][s], (codec, rank, s)
                assert torch.equal(diloco[rank][codec]["after"][s], diloco[0][codec]["after"][s]), (codec, rank, s)
        for rank in range(4):
            stats = diloco[rank][codec]["stats"]
            assert stats["topology"] == {"nodes": 2, "workers_per_node": 2, "kind": "hierarchical"}, codec


def test_diloco_sync_is_the_mean_of_the_nodes_and_each_worker_sends_half(diloco):
    """codec none, outer_lr 1, no momentum: after a sync every replica is the mean of the two nodes' parameters
    (the node's reduce-scatter sums its 2 equal outer gradients and divides by 2). Between nodes each worker sends
    its half of the outer gradient, dense: 2 (N-1)/N x 4 bytes x ceil(n/2) (the finiteness is read on the reduced
    values, no flag); int8 less than half of that."""
    for s in range(DILOCO_SYNCS):
        mean = (diloco[0]["none"]["before"][s] + diloco[2]["none"]["before"][s]) / 2
        assert torch.allclose(diloco[0]["none"]["after"][s], mean, rtol=1e-6, atol=1e-7), s
    numels = [32 * 64, 64, 64 * 8, 8]
    per_sync = 4 * sum(-(-n // 2) for n in numels)  # one all-reduce between 2 nodes: 1 x the bytes
    for rank in range(4):
        assert diloco[rank]["none"]["stats"]["inter_node_bytes"] == DILOCO_SYNCS * per_sync, rank
        assert 0 < diloco[rank]["int8"]["stats"]["inter_node_bytes"] < DILOCO_SYNCS * per_sync / 2, rank


# ---------------------------------------------------------------- FSDP's reduce-scatter across nodes
FSDP_STEPS = 3
FSDP_CASES = [("plain", None, {}), ("none", "none", {"topology": 2}), ("int8", "int8", {"topology": 2}),
              ("int8 flat", "int8", {"topology": "flat"}), ("int8 bf16", "int8", {"topology": 2, "intra_node": "bf16"}),
              ("poisoned", "int8", {"topology": 2, "poison": 1})]


@pytest.fixture(scope="module")
def fsdp():
    pytest.importorskip("torch.distributed.fsdp")
    return launch.run(nw.fsdp_nodes, 4, FSDP_CASES, FSDP_STEPS, timeout=TIMEOUT)


def _rel(got, ref):
    num = sum(float((a - b).double().square().sum()) for a, b in zip(got, ref))
    return math.sqrt(num / sum(float(b.double().square().sum()) for b in ref))


def test_fsdp_hierarchical_none_equals_plain_fsdp(fsdp):
    for rank in range(4):
        for got, ref in zip(fsdp[rank]["none"]["grads"], fsdp[rank]["plain"]["grads"]):
            assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got, ref)), rank
        assert fsdp[rank]["none"]["stats"]["topology"]["kind"] == "hierarchical"


def test_fsdp_hierarchical_int8_close_and_fewer_bytes_between_nodes(fsdp):
    """int8 on the node sums: within 2 % of the exact average (one rounding to nearest, error feedback on); the
    bytes between nodes < 0.4 of the flat exchange's (an all-to-all of 1/2 of the buffer among 2 nodes against
    3/4 of it among 4 workers), the intra bytes halved by bf16."""
    for rank in range(4):
        for name in ("int8", "int8 bf16"):
            for step in range(FSDP_STEPS):
                err = _rel(fsdp[rank][name]["grads"][step], fsdp[rank]["exact"])
                assert 0 < err < 0.02, (name, rank, step, err)
        hier, flat = fsdp[rank]["int8"]["stats"], fsdp[rank]["int8 flat"]["stats"]
        assert 0 < hier["inter_node_bytes"] < 0.4 * flat["inter_node_bytes"], (hier, flat)
        bf16 = fsdp[rank]["int8 bf16"]["stats"]
        assert bf16["inter_node_bytes"] == hier["inter_node_bytes"]
        assert abs(2 * bf16["intra_node_bytes"] - hier["intra_node_bytes"]) <= 16 * FSDP_STEPS * 8, (bf16, hier)


def test_fsdp_hierarchical_an_inf_on_one_worker_is_skipped_everywhere(fsdp):
    for rank in range(4):
        got = fsdp[rank]["poisoned"]
        assert got["stats"]["skipped"] == 1 and got["stats"]["steps"] == FSDP_STEPS, rank
        assert any(not bool(torch.isfinite(g).all()) for g in got["grads"][1]), rank
        assert all(bool(torch.isfinite(g).all()) for g in got["grads"][2]), rank
        flat = [torch.cat([g.reshape(-1) for g in grads]) for grads in got["grads"]]
        ref = [torch.cat([g.reshape(-1) for g in grads]) for grads in fsdp[rank]["int8"]["grads"]]
        assert torch.equal(flat[0], ref[0]), rank
        assert torch.equal(flat[2], ref[1]), rank  # nothing was committed at the skipped step

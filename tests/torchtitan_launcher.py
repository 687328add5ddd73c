"""torchtitan 0.3.0 on CPU with gloo, for the tests: apply the CPU shims, then run ``torchtitan.train.main()``.

Started by ``python -m torch.distributed.run ... tests/torchtitan_launcher.py <torchtitan's own options>``
(:func:`torchtitan_harness.torchrun`). torchtitan assumes CUDA; each shim below names the torchtitan line it works
around. They live here, in the tests, and change nothing of what is trained: the library under test
(``gradcompress.integrations.torchtitan``) runs unshimmed.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

TITAN = "torchtitan 0.3.0"


def cpu_device_type() -> None:
    """``torchtitan/tools/utils.py:55``: ``_get_available_device_type() or "cuda"`` makes every process a CUDA
    process on a machine without an accelerator. Import that module while the query answers ``"cpu"``, so its
    ``device_type, device_module`` (line 60, imported by name everywhere) are ``"cpu", torch.cpu``."""
    import torch._utils as tu

    original = tu._get_available_device_type
    tu._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils as titan_utils
    finally:
        tu._get_available_device_type = original
    assert titan_utils.device_type == "cpu", f"{TITAN}: torchtitan.tools.utils was imported before the shim"


class CPUMemoryMonitor:
    """Stands for ``torchtitan/components/metrics.py:38-92`` ``DeviceMemoryMonitor``, whose ``__init__`` (lines
    42-50) and ``get_peak_stats`` (line 62) call CUDA-only ``device_module`` functions (``get_device_name``,
    ``get_device_properties``, ``memory_stats``, ``reset_peak_memory_stats``) that ``torch.cpu`` lacks. Reports
    zeros: the step log's memory column reads 0.00GiB on CPU."""

    device_name = "cpu"

    def get_peak_stats(self) -> Any:
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


def cpu_memory_monitor() -> None:
    """``torchtitan/components/metrics.py:95`` ``build_device_memory_monitor`` (called by ``MetricsProcessor``,
    line 343) returns a :class:`CPUMemoryMonitor`."""
    import torchtitan.components.metrics as metrics

    metrics.build_device_memory_monitor = CPUMemoryMonitor


def dense_block_mask(block_mask: Any, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """The boolean (batch, 1, q_len, kv_len) mask a FlexAttention ``BlockMask`` stands for (its ``mask_mod``)."""
    from torch.nn.attention.flex_attention import create_mask

    return create_mask(block_mask.mask_mod, batch, None, q_len, kv_len, device=device)


def sdpa_flex_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod: Any, block_mask: Any,
                   scale: float | None, enable_gqa: bool, return_aux: Any, kernel_options: dict) -> tuple:
    """FlexAttention's call computed by ``scaled_dot_product_attention`` on the block mask made dense: the same
    attention (block-causal within each document), with a backward on CPU."""
    if score_mod is not None or return_aux.lse:
        raise NotImplementedError(f"{TITAN} CPU shim: FlexAttention with a score_mod or an lse output")
    mask = dense_block_mask(block_mask, q.shape[0], q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), None


def cpu_attention() -> None:
    """``torch/nn/attention/flex_attention.py:2082`` (torch 2.13.0) raises "FlexAttention does not support backward
    on CPU", and the
    language models cannot pick another backend (``torchtitan/models/common/config_utils.py:97-101`` refuses sdpa;
    varlen is CUDA's). ``torchtitan/models/common/attention.py:287-310`` ``FlexAttention.compiled_flex_attn`` is
    computed by :func:`sdpa_flex_attn` instead, and ``attention.py:622`` ``create_block_mask``, compiled with
    inductor (about 10 s per process on CPU), runs eagerly."""
    from torch.nn.attention.flex_attention import create_block_mask
    import torchtitan.models.common.attention as attention

    attention.FlexAttention.compiled_flex_attn = staticmethod(sdpa_flex_attn)
    attention._compiled_create_block_mask = create_block_mask


def gloo_sum_reduction() -> None:
    """``torchtitan/distributed/fsdp.py:41`` sets FSDP's gradient divide factor to 1.0, so FSDP2 reduce-scatters
    with ``PREMUL_SUM(1.0)``, which gloo refuses. Also force FSDP's sum reduction there
    (``set_force_sum_reduction_for_comms``): ``SUM`` then a post-divide by 1.0, the same gradients."""
    import torchtitan.distributed.fsdp as titan_fsdp

    original = titan_fsdp.disable_fsdp_gradient_division

    def disable_division_with_sum(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, titan_fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = disable_division_with_sum


def set_pg_timeout(timeout: datetime.timedelta, group: dist.ProcessGroup | None = None) -> None:
    """``torch.distributed.set_timeout`` as torchtitan calls it, through ``ProcessGroup.set_timeout``."""
    (group or dist.group.WORLD).set_timeout(timeout)  # type: ignore[union-attr]


def set_timeout() -> None:
    """``torchtitan/distributed/utils.py:595`` calls ``torch.distributed.set_timeout(timeout, group)``, missing in
    torch 2.13; the same through ``ProcessGroup.set_timeout``. Its barrier at line 586 passes
    ``device_ids=[torch.cpu.current_device()]`` (``["cpu"]``), which gloo cannot take: that barrier runs without
    ``device_ids``."""
    import torchtitan.distributed.utils as titan_dist

    dist.set_timeout = set_pg_timeout  # type: ignore[attr-defined]
    original = titan_dist.set_pg_timeouts

    def set_pg_timeouts(timeout: datetime.timedelta, parallel_dims: Any) -> None:
        barrier = dist.barrier
        dist.barrier = lambda *a, device_ids=None, **k: barrier(*a, **k)
        try:
            original(timeout, parallel_dims)
        finally:
            dist.barrier = barrier

    titan_dist.set_pg_timeouts = set_pg_timeouts


def save_parameters_at_close(folder: str) -> None:
    """Test instrumentation, not a shim: ``Trainer.close`` (``torchtitan/trainer.py``, called by
    ``torchtitan/train.py`` after training) first saves this rank's local parameters (``to_local()`` of each
    DTensor) to ``folder/rank<r>.pt``, for the tests to compare replicas; with a DiLoCo scheme also DiLoCo's anchors
    (``diloco.anchor.<i>``)."""
    from torchtitan.trainer import Trainer

    close = Trainer.close

    def save_then_close(self: Trainer) -> None:
        params = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                  for n, p in self.model_parts[0].named_parameters()}
        diloco = getattr(self, "diloco", None)  # with a DiLoCo scheme: its anchors (local shards) as well
        params.update({f"diloco.anchor.{i}": a.detach().clone() for i, a in enumerate(diloco.anchor)} if diloco else {})
        torch.save(params, os.path.join(folder, f"rank{dist.get_rank()}.pt"))
        close(self)

    Trainer.close = save_then_close


def fault_tolerance_hooks(announce: str, wait: str, ready: str = "", timeout: float = 120.0) -> None:
    """Test instrumentation for the fault-tolerance tests, not a shim. ``announce`` (a path, or empty): once this
    process has asked for its first quorum (torchft's ``Manager.start_quorum``, called by torchtitan's optimizer
    wrapper every step or by gradcompress's DiLoCo at a sync; the request is sent from torchft's quorum thread),
    that file is created half a second later: a restarted group's request is then pending at the lighthouse when a
    waiting survivor asks (torchft's lighthouse forms a "fast quorum" of the previous quorum's members without
    waiting for a newcomer that has not asked yet). ``wait`` (``"STEP:PATH"``, or empty): before training step STEP
    of torchtitan's ``FaultTolerantTrainer`` (``torchtitan/experiments/torchft/trainer.py``), wait (at most
    ``timeout`` seconds) until PATH exists; several such gates are separated by commas. ``ready`` (a path, or
    empty): created when this process is about to train its first step (a survivor's first gate waits for the
    other group's: both then ask for their first quorum together, and a slow start cannot leave one group alone
    at the lighthouse while the other waits at a later gate, which torchft's lighthouse would never resolve:
    a quorum needs more than half of the heartbeating replicas)."""
    import threading
    import time

    from torchft import Manager
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer

    if announce:
        start_quorum = Manager.start_quorum

        def start_quorum_then_announce(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = start_quorum(self, *args, **kwargs)
            if not os.path.exists(announce):
                threading.Timer(0.5, lambda: open(announce, "w").close()).start()
            return result

        Manager.start_quorum = start_quorum_then_announce
    if wait or ready:
        gates = {int(at): path for at, path in (gate.split(":", 1) for gate in wait.split(",") if gate)}
        train_step = FaultTolerantTrainer.train_step

        def wait_then_step(self: Any, data_iterator: Any) -> Any:
            if ready and not os.path.exists(ready):
                open(ready, "w").close()
            if self.step in gates:
                end = time.monotonic() + timeout
                while not os.path.exists(gates[self.step]):
                    if time.monotonic() > end:
                        raise TimeoutError(f"test instrumentation: {gates[self.step]} did not appear")
                    time.sleep(0.05)
            return train_step(self, data_iterator)

        FaultTolerantTrainer.train_step = wait_then_step


def apply_shims() -> None:
    """All the CPU shims, the device type first (before anything imports ``torchtitan.tools.utils``)."""
    cpu_device_type()
    cpu_memory_monitor()
    cpu_attention()
    gloo_sum_reduction()
    set_timeout()


def apply_cuda_shims() -> None:
    """On a GPU (``TORCHTITAN_DEVICE=cuda``, benchmarks/gpu_check.sh): torchtitan runs as it is, but for
    ``torch.distributed.set_timeout`` where this torch lacks it (``distributed/utils.py:595``)."""
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = set_pg_timeout  # type: ignore[attr-defined]


if __name__ == "__main__":
    if os.environ.get("TORCHTITAN_DEVICE") == "cuda":
        apply_cuda_shims()
    else:
        apply_shims()
    if os.environ.get("TORCHTITAN_TEST_PARAMS"):
        save_parameters_at_close(os.environ["TORCHTITAN_TEST_PARAMS"])
    if os.environ.get("TORCHTITAN_TEST_PIDS"):  # where a test that kills the run finds this worker
        with open(os.path.join(os.environ["TORCHTITAN_TEST_PIDS"], f"pid{os.environ['RANK']}"), "w") as f:
            f.write(str(os.getpid()))
    hooks = [os.environ.get(f"TORCHTITAN_TEST_{name}", "") for name in ("ANNOUNCE", "WAIT", "READY")]
    if any(hooks):
        fault_tolerance_hooks(*hooks)
    from torchtitan.train import main

    main()

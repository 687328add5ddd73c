"""Thin adapters from training frameworks to the step protocol of :mod:`gradcompress.step`.

* :mod:`.ddp`: the ``DistributedDataParallel`` communication hook;
* :mod:`.fsdp`: the compressed reduce-scatter for FSDP2 (``fully_shard``);
* :mod:`gradcompress.integrations.lightning`: a Lightning ``DDPStrategy`` (optional extra).

Each uses only the public API of :class:`gradcompress.Compressor` and :class:`gradcompress.step.Step`.
"""

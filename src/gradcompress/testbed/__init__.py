"""The testbed: where gradcompress is run on more than one process, here on one machine.

* :mod:`.launch` — N local worker processes with a gloo process group on loopback (``run``, ``free_port``,
  ``WorkerError``): the demo, ``train`` without torchrun and the tests use it;
* :mod:`.netns` — emulated hosts: Linux network namespaces on one bridge, each link shaped with ``tc`` (``Testbed``);
* :mod:`.hosts` — one worker process per emulated host (or G per node), their configs, results and the teardown
  on every way out (``run_workers``; the workers' side: ``worker_config``, ``read_tx_bytes``, ``write_result``);
* :mod:`.netbench` — the benchmark runner ``gradcompress netbench`` drives: every scheme on every host, timed, the
  interfaces' bytes counted, the ranks' records merged (``bench``); its FSDP-on-nodes schemes in
  :mod:`.netbench_fsdp`;
* :mod:`.models` — the benchmark models (netbench's and ``plan --model``'s), :mod:`.lm` the byte-level language
  model (also the ``--task lm`` of ``demo`` and ``train``);
* :mod:`.host_syncs` — ``HostSyncs``: the host synchronisations of a step counted (``.item()``, ``tolist()``,
  ``nonzero``...: the ops after which a GPU step's host waits), on any device (``bench --in-step`` reports them).

Library level: nothing here imports :mod:`gradcompress.cli` (the command line is a thin adapter over this). The
package imports none of its modules by itself: ``from gradcompress.testbed import launch``.
"""

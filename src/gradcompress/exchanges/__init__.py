"""One exchange per algebra of the codecs' payloads, each a small class in the shape of FSDP2's ``Comm``.

An exchange is built on the :class:`~gradcompress.collectives.Collectives` (the process group) it runs on and
the codec it carries, says which tensors it takes, and returns a job for ``(context, keys, inputs, outputs)``:
it owns its encode, its collective rounds, its decode and the place where finiteness is read, and writes new
state only through the step's :class:`~.context.Context`. It never calls back into the step, and one exchange
can wrap another (:class:`~.grouped.GroupExchange` wraps the algebra's exchange of a group of gradients).

* :mod:`.dense` — an all-reduce of the tensors as they are (``none``, warm-up steps);
* :mod:`.summed` — payloads that add (fp16/bf16 casts, random-k): one all-reduce;
* :mod:`.twostep` / :mod:`.bucketed` — quantisers: all-to-all, the owner sums and re-encodes, all-gather;
* :mod:`.gathered` — sparsifiers: all-gather, add at the positions;
* :mod:`.lowrank` — PowerSGD's P and Q rounds;
* :mod:`.reduce_scatter` — the compressed reduce-scatter of FSDP2;
* :mod:`.grouped` — a group of gradients: small tensors dense, the others through their algebra's exchange;
* :mod:`.layout` — how tensors are cut into chunks and buckets; :mod:`.context` — the step's context.
"""

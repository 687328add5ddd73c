"""An alpha-beta model of one data-parallel training step with gradient compression, timing the bytes and rounds
of collectives recorded from the real step (:func:`record_step`).

Used by ``gradcompress plan``; checked against ``gradcompress netbench`` in BENCHMARKS.md.
Units: bytes, seconds; a link's payload bandwidth ``B`` in bytes/s (:func:`payload_bandwidth`
turns a link rate in bit/s into it), ``alpha`` the fixed cost of one message step (the
one-way latency plus a software overhead per message).

Collectives, W workers, each behind its own full-duplex link (as ``Collectives`` counts them):

* all-reduce of M bytes (ring: reduce-scatter + all-gather):  2(W-1)/W M/B + 2(W-1) alpha
* all-gather of M bytes per rank (ring):                        (W-1) M/B + (W-1) alpha
* all-to-all of M bytes per rank (equal blocks):               (W-1)/W M/B + (W-1) alpha
* two-step reduce of a compressed size Mc (all-to-all + all-gather of the Mc/W re-encoded
  chunk):                                                       2(W-1)/W Mc/B + 2(W-1) alpha

What each scheme sends is not derived here: it is recorded from the real step (:func:`record_step`). Our
Compressor runs one compressed step of the model's tensors, one exchange per DDP bucket (:func:`buckets_for`), on
:class:`gradcompress.collectives.RecordingCollectives`, which counts bytes exactly as ``Compressor.stats()`` does
and records each collective (kind, bytes, group) per round; on nodes, with a recording topology, the Compressor runs
its hierarchical exchange. PyTorch's baselines are the collectives their hooks issue, replayed on the same
recorder (:func:`hook_job`). The data is :func:`gradients`, the data ``plan`` calibrates on. What variable-size
codecs (``dgc``, ``threshold``) send depends on it and on the rank: for them the second step is recorded (the
first with error-feedback residuals and momentum), on every rank, and each collective counted at the most any
rank of its group sent (the padded all-gather sends the longest payload).
A round's time: its collectives share the link (their bytes add) and are in flight together (the longest chain
of message steps counts once).

The step (:func:`simulate_step`): forward (1/3 of the compute time), then backward (2/3).
DDP hands a bucket to the hook when its gradients are ready (after the share of the
backward pass proportional to the parameters behind it, in reverse order); the hook's
codec work runs on the backward thread and delays the rest of it; the bucket's first
round of collectives starts then and overlaps with the remaining backward pass. The link
carries one collective at a time (first come, first served). Later rounds (and the codec
work between rounds) run after the backward pass, bucket after bucket, as
``exchange.drive`` does; PyTorch's PowerSGD hook has one bucket so the same holds.
Codec work is counted in passes over the elements with per-element costs measured on
the machine (:class:`Speeds`): encode, decode and one elementwise pass (error feedback
adds, copies) per codec, or, better, measured per phase on our Compressor itself
(``Speeds.phases``), multiplied by ``contention`` when workers share CPU cores. The
compute time is that of a DDP step without communication (DDP's own copies included).
"""

from __future__ import annotations

from ..spec import BASELINES, Scheme
from ..timing import (BACKWARD_SHARE, FRAMING_EFFICIENCY, MESSAGE_STEPS, SOFTWARE_ALPHA, BucketWork, Round,
                      StepTime, format_rate, message_steps, parse_duration, parse_rate, payload_bandwidth,
                      round_seconds, simulate_step)
from .auto import SELECTION_HYSTERESIS, AutoPrediction, predict_auto
from .flat import (Prediction, auto_candidates, default_error_feedback, predict, predict_plan, square_shapes,
                   with_speedups)
from .nodes import (INTRA_NODE_RATE_BIT, node_bucket_work, node_bytes, node_rounds, node_uplink_bytes,
                    predict_nodes)
from .recording import (GRADIENT_SCALE, RECORDED_STEPS, Recorded, gradients, hierarchical_supported, hook_job,
                        record_step, wire_bytes)
from .sizes import (DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, DEFAULT_SCHEMES, FLOAT_BYTES, MIN_NUMEL,
                    allgather_time, allreduce_time, alltoall_time, buckets_for, ddp_buckets,
                    modelled_scheme, numel_of, parse_scheme, payload_bytes, two_step_time)
from .sizes import _compressible as _compressible  # read by the tests (which tensors a scheme compresses)
from .work import Speeds, bucket_work, codec_passes, phase_key, speed_codec

__all__ = ["BACKWARD_SHARE", "BASELINES", "DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES", "DEFAULT_SCHEMES",
           "FLOAT_BYTES", "FRAMING_EFFICIENCY", "GRADIENT_SCALE", "INTRA_NODE_RATE_BIT", "MESSAGE_STEPS", "MIN_NUMEL",
           "RECORDED_STEPS", "SELECTION_HYSTERESIS", "SOFTWARE_ALPHA", "AutoPrediction", "BucketWork", "Prediction",
           "Recorded", "Round", "Scheme", "Speeds", "StepTime", "allgather_time", "allreduce_time", "alltoall_time",
           "auto_candidates", "bucket_work", "buckets_for", "codec_passes", "ddp_buckets", "default_error_feedback",
           "format_rate", "gradients", "hierarchical_supported", "hook_job", "message_steps", "modelled_scheme",
           "node_bucket_work", "node_bytes", "node_rounds", "node_uplink_bytes", "numel_of", "parse_duration",
           "parse_rate", "parse_scheme", "payload_bandwidth", "payload_bytes", "phase_key", "predict", "predict_auto",
           "predict_nodes", "predict_plan", "record_step", "round_seconds", "simulate_step", "speed_codec",
           "square_shapes", "two_step_time", "wire_bytes", "with_speedups"]

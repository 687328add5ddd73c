"""Compatibility names: what lived here now lives in :mod:`gradcompress.collectives` (collectives, jobs,
serialisation) and :mod:`gradcompress.exchanges` (one module per algebra)."""

from .collectives import (Collectives, Done, Job, LocalCollectives, Running, drive, floats, from_bytes, layout,
                          nbytes, parallel, to_bytes)
from .exchanges.bucketed import bucketed_two_step_mean
from .exchanges.dense import dense_mean
from .exchanges.gathered import gather_mean
from .exchanges.layout import (CHUNK_BLOCK, WHOLE_GROUP_SLACK, chunk_numel, fills_buckets, split_chunks,
                               whole_group_elements)
from .exchanges.reduce_scatter import reduce_scatter_sum
from .exchanges.summed import sum_mean
from .exchanges.twostep import two_step_mean

__all__ = ["CHUNK_BLOCK", "Collectives", "Done", "Job", "LocalCollectives", "Running", "WHOLE_GROUP_SLACK",
           "bucketed_two_step_mean", "chunk_numel", "dense_mean", "drive", "fills_buckets", "floats", "from_bytes",
           "gather_mean", "layout", "nbytes", "parallel", "reduce_scatter_sum", "split_chunks", "sum_mean",
           "to_bytes", "two_step_mean", "whole_group_elements"]

"""The state key of one FSDP2 reduce-scatter (or replica all-reduce): named by what is in the buffer.

FSDP2 reduce-scatters a module group's gradients once per backward in the common case, but a group may do it
several times in one training step, each time with the parameters whose gradients were ready: torchtitan's chunked
loss reduce-scatters the ``[norm, output]`` group's ``output`` gradient in the chunks' own backward and its
``norm`` gradient in the decoder's; a module called twice in one forward is reduce-scattered after each of its
backwards. Each such buffer needs state of its own (a residual of its size, error feedback on its content), so the
key says which parameters the buffer holds:

- the whole group: ``fsdp:<module>`` (the key of every earlier version: checkpoints keep loading);
- a subset: ``fsdp:<module>[<param>,<param>]``, the subset found from the buffer's size and the group's parameter
  sizes (FSDP lays the buffer out as every parameter's padded shard in the group's order), or
  ``fsdp:<module>[<n>/rank]`` where the size does not name one subset;
- the same buffer again within one compressor step: ``#2``, ``#3``, ... appended (its own residual: error feedback
  holds per key, and the backward's order is the same at every step and on every rank).
"""

from __future__ import annotations

import itertools
import weakref

import torch

#: a group with more parameters than this is keyed by size alone where it is reduced in parts (2^n subsets)
MAX_SUBSET_SEARCH = 16


def group_params(module: torch.nn.Module, names: dict[int, str]) -> list[tuple[str, int]]:
    """(name, elements per rank) of each parameter of ``module``'s FSDP group, in the order FSDP lays them out in
    its reduce-scatter buffer; ``names``: module id -> its name in the model. Empty where torch's FSDP internals are
    not as expected (the keys then fall back to sizes)."""
    try:
        groups = module._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]  # FSDPModule's own method
        params = [p for g in groups for p in g.fsdp_params]
        out = []
        for p in params:
            owner = names.get(id(p._module_info.module), "?")
            name = p._module_info.param_name if owner in ("", "root") else f"{owner}.{p._module_info.param_name}"
            out.append((name, int(p.padded_sharded_param_size.numel())))
        return out
    except (AttributeError, TypeError):
        return []


def _subsets(params: list[tuple[str, int]], numel: int) -> list[tuple[str, ...]]:
    """Every ordered subset of ``params`` whose sizes add up to ``numel`` (at most two: one is the answer)."""
    found: list[tuple[str, ...]] = []
    for picks in itertools.product((False, True), repeat=len(params)):
        if sum(n for (_, n), pick in zip(params, picks) if pick) == numel:
            found.append(tuple(name for (name, _), pick in zip(params, picks) if pick))
            if len(found) > 1:
                break
    return found


class GroupKeys:
    """The keys of one FSDP group's buffers (module doc): ``key(step, numel_per_rank)``."""

    def __init__(self, base: str, params: list[tuple[str, int]]):
        self.base, self.params = base, params
        self.whole = sum(n for _, n in params)
        self._by_size: dict[int, str] = {}
        self._step: weakref.ref | None = None  # the step the counts in _used are of
        self._used: dict[str, int] = {}

    def content(self, numel: int) -> str:
        """The key of a buffer of ``numel`` elements per rank, before repeats are counted."""
        got = self._by_size.get(numel)
        if got is None:
            got = self._by_size[numel] = self._name(numel)
        return got

    def _name(self, numel: int) -> str:
        if not self.params or numel == self.whole:
            return self.base
        subsets = _subsets(self.params, numel) if len(self.params) <= MAX_SUBSET_SEARCH else []
        if len(subsets) == 1:
            return f"{self.base}[{','.join(subsets[0])}]"
        return f"{self.base}[{numel}/rank]"

    def key(self, step: object, numel: int) -> str:
        """The key of this buffer in ``step``: its content's, with ``#k`` for its k-th reduction in that step."""
        if self._step is None or self._step() is not step:
            self._step, self._used = weakref.ref(step), {}
        key = self.content(numel)
        seen = self._used[key] = self._used.get(key, 0) + 1
        return key if seen == 1 else f"{key}#{seen}"


__all__ = ["GroupKeys", "MAX_SUBSET_SEARCH", "group_params"]

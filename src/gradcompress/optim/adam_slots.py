"""The Compressor's state slots of :class:`~gradcompress.optim.onebit_adam.CompressedAdam` (worker and server
residuals, PowerSGD's factors) as views of the optimizer's per-parameter state, their only owner
(:class:`ParamState`): checkpoints hold them and a non-finite step commits nothing."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Protocol


class _Owner(Protocol):
    """What a slot reads of its optimizer (:class:`~gradcompress.optim.onebit_adam.CompressedAdam`): its state, its
    parameters in key order, and the Compressor's key of a parameter."""

    state: Any
    _by_key: list

    def _slot_key(self, key: int) -> Any: ...


def _position(key) -> int | None:
    """The parameter position of a Compressor state key: an int, or a piece key ``"<position>:<j>/<G>"``."""
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    head, sep, tail = str(key).partition(":")
    return int(head) if sep and head.isdigit() and tail else None


class ParamState(MutableMapping):
    """One state slot of the Compressor (worker or server residual, PowerSGD's factors) seen through the
    optimizer's per-parameter state entry ``name``: key = the parameter's position among the optimizer's
    parameters, or under a hierarchical topology this rank's piece of it (``"3:0/2"``: the entry then holds the
    piece's residual). The optimizer's state is the only owner (checkpoints hold it); the step's commit writes
    there."""

    def __init__(self, optimizer: _Owner, name: str):
        self.optimizer, self.name = optimizer, name

    def _param(self, key):
        params = self.optimizer._by_key
        position = _position(key)
        if position is None or not 0 <= position < len(params) or self.optimizer._slot_key(position) != key:
            raise KeyError(key)
        return params[position]

    def __getitem__(self, key):
        state = self.optimizer.state.get(self._param(key))
        if not state or self.name not in state:
            raise KeyError(key)
        return state[self.name]

    def __setitem__(self, key, value) -> None:
        self.optimizer.state[self._param(key)][self.name] = value

    def __delitem__(self, key) -> None:
        del self.optimizer.state[self._param(key)][self.name]

    def __iter__(self):
        for key, p in enumerate(self.optimizer._by_key):
            if self.name in self.optimizer.state.get(p, {}):
                yield self.optimizer._slot_key(key)

    def __len__(self) -> int:
        return sum(1 for _ in self)


__all__ = ["ParamState"]

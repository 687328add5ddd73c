"""``State``: everything compression remembers between steps, in one place, and the counters of a Compressor.

A step never writes here before its end: new states are held aside by the step's
:class:`~gradcompress.exchanges.context.Context` and :meth:`State.commit` assigns them (or nothing is assigned:
rollback). Checkpoints (:meth:`State.state_dict`) hold tensors and plain values only; a state resumed at another
world size keeps what stays valid there (:meth:`State.resize`).
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Hashable, Iterable, Mapping, MutableMapping
from typing import Any

import torch

#: the state slots a Compressor keeps, each a dict key -> tensor
SLOTS = ("residual", "server_residual", "q", "p", "momentum")
#: slots whose replaced tensors are recycled as buffers (their new value never reads the old tensor in place)
RECYCLED = ("residual", "server_residual")
#: slots that belong to one rank of one world size: reset when a state resumes at another world size
PER_RANK_SLOTS = ("residual", "server_residual")
#: state keys of FSDP's parameter groups (``fsdp:<module name>``): flat buffers of W chunks, so world-dependent
FSDP_KEY_PREFIX = "fsdp:"
#: one slot's tensors by key (a parameter position, a group's name, a piece's ``"3:0/2"``); an optimizer's view
Slot = MutableMapping[Hashable, torch.Tensor]


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.is_contiguous()


def _key(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


class State:
    """``step``: committed steps (the schedule position); ``slots[name][key]``: per-key tensors, ``name`` one of
    :data:`SLOTS`: ``residual`` (worker error feedback), ``server_residual`` (the chunk owner's, two-step reduce),
    ``q``/``p`` (PowerSGD's warm-started factors), ``momentum`` (momentum correction). ``slots`` may be given: an
    optimizer that owns the per-parameter state (1-bit Adam) passes mappings that are views of its own.
    ``totals``: counters since this object was made (``Compressor.stats()``; not checkpointed)."""

    def __init__(self, slots: Mapping[str, Slot] | None = None) -> None:
        self.step = 0
        self.slots: dict[str, Slot] = {name: {} for name in SLOTS}
        self.slots.update(slots or {})
        #: (slot, key) -> the residual a commit replaced, reused as the next step's output buffer (not state)
        self.spare: dict[tuple[str, Hashable], torch.Tensor] = {}
        self.totals: dict[str, float] = {"steps": 0, "skipped": 0, "raw_bytes": 0, "codec_seconds": 0.0,
                                         "param_bytes": 0}

    def get(self, slot: str, key: Hashable) -> torch.Tensor | None:
        return self.slots[slot].get(key)

    def commit(self, new: Mapping[tuple[str, Hashable], torch.Tensor], index: int | None = None) -> None:
        """Assign a step's new states; the schedule position moves past step ``index`` (default: the current)."""
        for (slot, key), value in new.items():
            old = self.slots[slot].get(key)
            if slot in RECYCLED and old is not None and old is not value and _same_layout(old, value):
                self.spare[slot, key] = old  # nothing else holds it: it becomes the next new residual's buffer
            self.slots[slot][key] = value
        self.step = (self.step if index is None else index) + 1

    def count(self, committed: bool | None, raw_bytes: int, codec_seconds: float) -> None:
        """Add a closed step to the totals (``committed`` None: aborted, not counted as a step)."""
        if committed is not None:
            self.totals["steps"] += 1
            self.totals["skipped"] += not committed
        self.totals["raw_bytes"] += raw_bytes
        self.totals["codec_seconds"] += codec_seconds

    def take_spare(self, slot: str, key: Hashable, shape: torch.Size, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor | None:
        """A recycled buffer for ``slot``/``key`` of that layout, or None."""
        buf = self.spare.pop((slot, key), None)
        if buf is None or buf.shape != shape or buf.dtype != dtype or buf.device != device:
            return None
        return buf

    def forget(self, slots: Iterable[str], keys: Collection[Hashable]) -> None:
        """Drop the state of ``keys`` in ``slots`` (a key whose codec changed: PowerSGD's factors start fresh)."""
        for slot in slots:
            for key in keys:
                self.slots[slot].pop(key, None)
                self.spare.pop((slot, key), None)

    def add(self, slot: str, values: Mapping[Hashable, torch.Tensor]) -> None:
        """Add ``values`` (key -> tensor) to ``slot``: to what the key holds, or as its value (a layout switch moves
        residuals between keys, ``Session.relayout``)."""
        held = self.slots[slot]
        for k, v in values.items():
            held[k] = v if k not in held else held[k] + v

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step}
        for name, values in self.slots.items():
            out[name] = {str(k): v.clone() for k, v in values.items()}
        return out

    def shared_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` without the per-rank slots (:data:`PER_RANK_SLOTS`: empty): what a replica that
        rejoins receives from a peer (the schedule position, PowerSGD's factors, momentum)."""
        return {**self.state_dict(), **{slot: {} for slot in PER_RANK_SLOTS}}

    def load_state_dict(self, state: Mapping[str, Any], world: object = None) -> None:
        """Take a :meth:`state_dict` (``world``: the world size it says it was saved with, checked)."""
        if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
            raise ValueError(f"Compressor.load_state_dict: world must be an integer >= 1, got {world!r}")
        self.spare = {}
        self.step = int(state["step"])
        for name in SLOTS:
            self.slots[name] = {_key(k): v.clone() for k, v in state.get(name, {}).items()}

    def resize(self, saved: int, world: int) -> bool:
        """A state saved at ``saved`` workers resumes with ``world``: reset the per-rank residuals and FSDP's chunked
        momentum, keep the rest, warn. Returns whether anything was reset."""
        if saved == world:
            return False
        for slot in PER_RANK_SLOTS:
            self.slots[slot] = {}
        # FSDP's flat group buffers are laid out in W chunks: their momentum does not fit another world either
        chunked = [k for k in self.slots["momentum"] if str(k).startswith(FSDP_KEY_PREFIX)]
        for key in chunked:
            del self.slots["momentum"][key]
        self.spare = {}
        also = " and the momentum of FSDP's flat buffers (laid out in W chunks)" if chunked else ""
        warnings.warn(f"gradcompress: the compressor state was saved with {saved} workers and resumes with {world}: "
                      f"the per-rank error-feedback residuals ({', '.join(PER_RANK_SLOTS)}){also} were reset to "
                      f"zero; PowerSGD's factors (q, p), the momentum buffers and the step count ({self.step}) "
                      "were kept", UserWarning, stacklevel=4)
        return True


__all__ = ["FSDP_KEY_PREFIX", "PER_RANK_SLOTS", "RECYCLED", "SLOTS", "State"]

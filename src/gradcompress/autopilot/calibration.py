"""The autopilot's calibration cache: what each candidate cost on a bucket, kept on disk per machine and device.

At its first decision the autopilot runs every candidate's exchange of every bucket on a recording of the
collectives (:func:`.decide.record`): the rounds and bytes, and the codec's time on this device for those shapes
(the faster of two runs). The next run on the same machine, device type and library finds them here and runs
nothing: its first decision costs a lookup.

**Where** (decided once, when the autopilot is built): the ``auto:cache=PATH`` option (``off``: no cache), else
``$GRADCOMPRESS_CACHE`` (a file path; ``off`` turns the cache off), else
``$XDG_CACHE_HOME/gradcompress/calibration.json``, else ``~/.cache/gradcompress/calibration.json``. The file is read
once, at the first decision. One JSON object, entry key -> ``{"rounds": [[[kind, nbytes, sent, world, link], ...],
...], "codec_s": seconds}``.

**What a key covers** (a hash of all of it): the machine (CPU model and flags, or the CUDA device's name and
capability), torch's version, a hash of the library's own source (any change of the code is a miss, whatever the
version string says), torch's thread count, the candidate's spec, the bucket's shapes and kind, the group's size
and the Compressor's configuration (error feedback, ``min_numel``, residual dtype). A change of any of these is a
miss, measured and added.

Every rank reads and writes the same file on a machine; a write replaces the file atomically (a rank's entries may
be lost to another's write at the same moment, never half-written). An unreadable file is ignored (and replaced at
the next write) with a warning; an unwritable one leaves the cache in memory for this run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import platform
import tempfile
import warnings
from typing import TYPE_CHECKING

import torch

from ..collectives import Issued

if TYPE_CHECKING:
    from ..config import Config
    from ..terms import Seen

ENV = "GRADCOMPRESS_CACHE"


def path(option: str | None = None) -> str | None:
    """The cache file: ``option`` (the ``auto:cache=`` option) if given, else from the environment; None: off."""
    given = option or os.environ.get(ENV)
    if given:
        return None if given.strip().lower() == "off" else given
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "gradcompress", "calibration.json")


def _cpu() -> str:
    """The CPU's model name and a hash of its flags (the first processor of ``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return platform.processor() or platform.machine()
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    flags = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:12]
    return f"{fields.get('model name', platform.machine())}/{flags}"


def machine(device: torch.device | str | None) -> str:
    """What codec times on ``device`` depend on: the CPU or the CUDA device, torch, gradcompress, threads."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}/{torch.cuda.get_device_capability(device)}"
    else:
        where = _cpu()
    return f"{device.type}|{where}|torch {torch.__version__}|gradcompress {source_hash()}|{torch.get_num_threads()}"


@functools.cache
def source_hash() -> str:
    """A hash of the library's own source files (Python and C++), read once per process."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp")):
        h.update(str(file.relative_to(root)).encode())
        h.update(file.read_bytes())
    return h.hexdigest()[:16]


def key(config: Config, world: int, seen: Seen, spec: str) -> str:
    """The cache key of candidate ``spec`` on the group ``seen`` (a :class:`~gradcompress.step.Seen`)."""
    parts = [machine(seen.device), spec, world, seen.kind, seen.shapes, seen.out, seen.scale,
             config.error_feedback, config.min_numel, str(config.residual_dtype), config.seed]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class Cache:
    """The entries of the cache ``file`` (None: in memory only), read once, at the first use; :meth:`put` adds and
    writes them back. ``Cache.at(option)``: the file :func:`path` names."""

    def __init__(self, file: str | None = None):
        self.file = file
        self._entries: dict | None = None

    @classmethod
    def at(cls, option: str | None = None) -> Cache:
        return cls(path(option))

    @property
    def entries(self) -> dict:
        if self._entries is None:
            self._entries = self._read(quiet=False)
        return self._entries

    def _read(self, quiet: bool) -> dict:
        """The file's entries ({} when there is none or it is unreadable: a warning unless ``quiet``)."""
        if self.file is None or not os.path.exists(self.file):
            return {}
        try:
            with open(self.file) as f:
                data = json.load(f)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return data
        except (OSError, ValueError) as err:
            if not quiet:
                warnings.warn(f"gradcompress auto: the calibration cache {self.file} is unreadable ({err}); "
                              "measuring again (it is replaced)", RuntimeWarning, stacklevel=3)
            return {}

    def get(self, entry: str) -> tuple[tuple, float] | None:
        """(rounds, codec seconds) of a cached entry, or None."""
        found = self.entries.get(entry)
        if found is None:
            return None
        try:
            rounds = tuple(tuple(Issued(*c) for c in r) for r in found["rounds"])
            return rounds, float(found["codec_s"])
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, items: dict) -> None:
        """Add ``items`` (entry -> (rounds, codec seconds)) and write the file (atomically; failures warn)."""
        if not items:
            return
        for entry, (rounds, seconds) in items.items():
            self.entries[entry] = {"rounds": [[list(c) for c in r] for r in rounds], "codec_s": seconds}
        if self.file is None:
            return
        try:
            os.makedirs(os.path.dirname(self.file) or ".", exist_ok=True)
            merged = {**self._read(quiet=True), **self.entries}  # with what another rank wrote since
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.file) or ".", prefix=".calibration-")
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f)
            os.replace(tmp, self.file)
        except OSError as err:
            warnings.warn(f"gradcompress auto: cannot write the calibration cache {self.file} ({err}); kept for "
                          "this run only", RuntimeWarning, stacklevel=3)


__all__ = ["Cache", "ENV", "key", "machine", "path", "source_hash"]

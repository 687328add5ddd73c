"""torchft's lighthouse server, started on 127.0.0.1 with a free port (tests, ``train --fault-tolerant``, the demo).

The lighthouse decides each step's quorum of live replica groups. ``heartbeat_timeout_ms``: how long after a
replica's last heartbeat it counts as dead (the stall after a kill is about this); ``join_timeout_ms``: how long a
quorum waits for replicas that are heartbeating but not yet asking (a restarted one).
"""

from __future__ import annotations


class Lighthouse:
    """torchft's own ``LighthouseServer`` in this process, on a port the system chooses.

    It sends nothing of the gradients: it decides each step's quorum of live replica groups (module docstring).
    ``address``: ``http://HOST:PORT`` (the server itself reports the machine's hostname, which may not resolve).

    Args:
        min_replicas: the fewest replica groups that form a quorum (default 1).
        host: the address it binds (default ``"127.0.0.1"``).
        join_timeout_ms: how long a quorum waits for replicas heartbeating but not yet asking (default 200).
        heartbeat_timeout_ms: how long after its last heartbeat a replica counts as dead (default 1000).
        quorum_tick_ms: how often the lighthouse re-evaluates the quorum (default 20).

    Example::

        >>> from gradcompress.integrations.torchft import Lighthouse
        >>> with Lighthouse(min_replicas=1) as lighthouse:   # shut down on leaving the block
        ...     lighthouse.address.startswith("http://127.0.0.1:")
        True
    """

    def __init__(self, min_replicas: int = 1, *, host: str = "127.0.0.1", join_timeout_ms: int = 200,
                 heartbeat_timeout_ms: int = 1000, quorum_tick_ms: int = 20) -> None:
        from torchft.coordination import LighthouseServer

        self.server = LighthouseServer(bind=f"{host}:0", min_replicas=min_replicas,
                                       join_timeout_ms=join_timeout_ms, quorum_tick_ms=quorum_tick_ms,
                                       heartbeat_timeout_ms=heartbeat_timeout_ms)
        self.address = f"http://{host}:{self.server.address().rsplit(':', 1)[1]}"

    def shutdown(self) -> None:
        self.server.shutdown()

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = ["Lighthouse"]

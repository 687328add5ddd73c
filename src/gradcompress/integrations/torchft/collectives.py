"""``ManagedCollectives``: gradcompress's collectives on a torchft ``Manager``'s quorum (:mod:`gradcompress.quorum`).

Every collective a compressed step issues (all-reduce, all-gather, all-to-all) runs on the process group the Manager
was given, through torchft's wrapper, for the current quorum; an error (a peer killed mid-exchange: "Connection
closed by peer", or the group's timeout) is **reported to the Manager instead of raised**: the step then runs to its
end without communicating, ``Manager.should_commit()`` says no on this replica, and torchft discards the step (what
torchft's own ``Manager.allreduce`` does).
"""

from ...quorum import QuorumCollectives as ManagedCollectives

__all__ = ["ManagedCollectives"]

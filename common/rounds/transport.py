"""The transport interface: how a level reaches the node above it.

An island reaches its relay, and a relay the aggregator, through an ``Upstream``: push
a delta, fetch a merge, report the final state applied.  Every call answers at once:

- ``push`` returns the node's ``Decision`` (accepted, duplicate, or refused with a code
  and a reason; "not now" is ``PRECONDITION``);
- ``fetch`` returns the committed merge, a refusal, or None: not committed yet;
- ``report_applied`` returns None when taken, or a refusal.

A peer that cannot be reached raises ``Unavailable``.  Waiting (retry "not now", retry
"unavailable", ask again for a merge that is not ready) is the caller's policy, not
the transport's: the daemons sleep and retry on their own threads, the in-process
cluster schedules a retry in virtual time.

Two implementations: the nodes themselves in one process (``LocalUpstream`` below, and
the message network of ``local.py`` that delivers calls to it with delays and faults),
and gRPC (``hypertrain.wire.upstream.GrpcUpstream``, client stubs to the daemons'
servicers, which call the same nodes).
"""

from __future__ import annotations

from typing import Protocol

from hypertrain.common.errors import HypertrainError
from hypertrain.common.rounds.machines import Committed, Decision, Delta
from hypertrain.common.rounds.node import AggregatorNode, RelayNode


class Unavailable(HypertrainError):
    """The peer could not be reached (down, partitioned, or the call was lost)."""


class Upstream(Protocol):
    """A node as the level below sees it (see the module docstring)."""

    def push(self, delta: Delta) -> Decision: ...

    def fetch(self, requester: str, sync_step: int, kind: str) -> Committed | Decision | None: ...

    def report_applied(self, requester: str, step: int) -> Decision | None: ...


class LocalUpstream:
    """``Upstream`` by plain calls to a node in the same process."""

    def __init__(self, node: RelayNode | AggregatorNode) -> None:
        self.node = node

    def push(self, delta: Delta) -> Decision:
        decision, _ = self.node.push(delta)
        return decision

    def fetch(self, requester: str, sync_step: int, kind: str) -> Committed | Decision | None:
        return self.node.fetch(self.node.cfg.run_id, requester, sync_step, kind)

    def report_applied(self, requester: str, step: int) -> Decision | None:
        if isinstance(self.node, AggregatorNode):
            return self.node.applied(requester, step)
        return None

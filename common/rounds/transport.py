"""The transport interface: how a level reaches the node above it.

An island reaches its relay, and a relay the aggregator, through an ``Upstream``: push
a delta, fetch a merge, report the final state applied.  Every call answers at once:

- ``push`` returns the node's ``Decision`` (accepted, duplicate, or refused with a code
  and a reason; "not now" is ``PRECONDITION``);
- ``fetch`` returns the committed merge, a refusal, or None: not committed yet;
- ``report_applied`` returns None when taken, or a refusal;
- ``member`` (an island to its relay) asks to join or leave the region; returns the
  relay's ``Decision`` (a join's ``start`` says which merge to start from).

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

import re
from typing import Any, Protocol

import torch

from hypertrain.common.digest import blob_digest
from hypertrain.common.errors import HypertrainError
from hypertrain.common.rounds.machines import (
    CORRUPT,
    INVALID,
    TOO_LARGE,
    Committed,
    Decision,
    Delta,
    MemberRequest,
)
from hypertrain.common.rounds.node import AggregatorNode, RelayNode


class Unavailable(HypertrainError):
    """The peer could not be reached (down, partitioned, or the call was lost)."""


class Upstream(Protocol):
    """A node as the level below sees it (see the module docstring)."""

    def push(self, delta: Delta) -> Decision: ...

    def fetch(
        self,
        requester: str,
        sync_step: int,
        kind: str,
        out: torch.Tensor | None = None,
        tap: Any = None,
    ) -> Committed | Decision | None:
        """``out``: where the payload may be received (a transport that copies it);
        ``tap``: told of the payload's progress while it arrives, by a transport that
        streams it (services/wire/chunks.MergeTap; others ignore it)."""
        ...

    def report_applied(self, requester: str, step: int) -> Decision | None: ...

    def member(self, request: MemberRequest) -> Decision: ...


_HEX64 = re.compile(r"[0-9a-f]{64}")


def transfer_refusal(delta: Delta, max_size: int) -> Decision | None:
    """What a transport checks before a node sees a delta (the gRPC transport checks the
    same while the chunks arrive, services/wire/chunks.py): a digest that is a blob digest, a
    size no encoding of the model exceeds, and bytes that are the ones the digest names."""
    if not _HEX64.fullmatch(delta.digest):
        return Decision(INVALID, f"digest {delta.digest!r} is not 64 lowercase hex digits")
    if len(delta.data) > max_size:
        return Decision(
            TOO_LARGE,
            f"delta of {len(delta.data)} bytes is over this receiver's limit of {max_size} bytes",
        )
    got = blob_digest(delta.data)
    if got != delta.digest:
        return Decision(CORRUPT, f"corrupt transfer: digest {got} != header digest {delta.digest}")
    return None


class LocalUpstream:
    """``Upstream`` by plain calls to a node in the same process."""

    def __init__(self, node: RelayNode | AggregatorNode) -> None:
        self.node = node

    def push(self, delta: Delta) -> Decision:
        refused = transfer_refusal(delta, self.node.max_delta_bytes)
        if refused is not None:  # not a delta, from nobody known: not taped
            return refused
        decision, _ = self.node.push(delta)
        return decision

    def fetch(
        self,
        requester: str,
        sync_step: int,
        kind: str,
        out: torch.Tensor | None = None,
        tap: Any = None,
    ) -> Committed | Decision | None:
        """The node's merge itself (nothing is copied or streamed in one process, so
        ``out`` and ``tap`` are unused)."""
        return self.node.fetch(self.node.cfg.run_id, requester, sync_step, kind)

    def report_applied(self, requester: str, step: int) -> Decision | None:
        return self.node.applied(requester, step)

    def member(self, request: MemberRequest) -> Decision:
        if not isinstance(self.node, RelayNode):
            return Decision(INVALID, "joins and leaves go to the region's relay")
        decision, _ = self.node.on_member(request)
        return decision

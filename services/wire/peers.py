"""The daemons' connection to their upstream peer (island -> relay, relay -> aggregator).

``Peer`` is the channel and the stubs (with the chunk codec, ``client.py``).  What is
said over it, and how long a daemon waits for an answer, is ``upstream.py``:
``GrpcUpstream`` (the transport interface over this channel) and ``Patient`` (the
daemons' waiting policy).
"""

from __future__ import annotations

from typing import Any

from hypertrain.common.trust.ledger import AGGREGATOR_KEY
from hypertrain.v1 import hypertrain_pb2 as pb
from hypertrain.wire.client import aggregator_stub, connect, relay_stub
from hypertrain.wire.tls import PLAINTEXT, Security

FETCH_DEADLINE_S = 120.0
"""The deadline of one merge download (the server holds a not-yet-committed fetch at most
``rounds.HOLD_S`` of it, then answers "ask again")."""


class Peer:
    """A channel to an upstream daemon and its stubs."""

    def __init__(
        self,
        address: str,
        service: str,
        wait_ready: bool = True,
        security: Security = PLAINTEXT,
        name: str = "",
    ) -> None:
        """``wait_ready``: fail now (UNAVAILABLE) if the peer is not reachable within
        ``connect``'s timeout; False: connect lazily, at the first call.  ``name``: the
        daemon's name its certificate must carry (with TLS)."""
        self.address = address
        self.service = service
        self.channel = (
            connect(address, security=security, peer=name)
            if wait_ready
            else security.channel(address, name)
        )
        stub: Any = (
            relay_stub(self.channel) if service == "Relay" else aggregator_stub(self.channel)
        )
        self._push = stub.PushDelta if service == "Relay" else stub.PushRegional
        self._fetch = stub.FetchMerge if service == "Relay" else stub.FetchGlobal
        self._status = stub.Status
        self._member = stub.Member if service == "Relay" else None

    def status(self, request: pb.StatusRequest | None = None) -> pb.StatusReply:
        reply: pb.StatusReply = self._status(request or pb.StatusRequest(), timeout=10)
        return reply

    def close(self) -> None:
        self.channel.close()


def relay_peer(
    address: str, wait_ready: bool = True, security: Security = PLAINTEXT, name: str = ""
) -> Peer:
    return Peer(address, "Relay", wait_ready, security, name)


def aggregator_peer(address: str, wait_ready: bool = True, security: Security = PLAINTEXT) -> Peer:
    return Peer(address, "Aggregator", wait_ready, security, AGGREGATOR_KEY)

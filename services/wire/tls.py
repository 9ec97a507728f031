"""Mutual TLS between the daemons, and who may make which call.

    security = Security.tls(TlsFiles.load(Path("keys/relay-eu.crt")))
    address = security.bind(server, "0.0.0.0:7070")          # requires client certificates
    channel = security.channel("agg.example:7070", "aggregator")
    callers = Callers(security, {"eu-0": "island-eu-0", "eu-1": "island-eu-1"})
    callers.check(context, header.sender, "push")             # PERMISSION_DENIED unless the
                                                              # certificate names eu-0's island

- A server with TLS accepts a connection only from a client presenting a certificate
  issued by the run's CA (``common/trust/certs.py``); a client without one, with one
  from another CA or an expired one fails the TLS handshake and never reaches a
  servicer (gRPC core refuses it; the caller sees UNAVAILABLE).
- A client checks the server's certificate against the name of the daemon it means to
  reach (``grpc.ssl_target_name_override``), not against the address it dialled: an
  island talks to ``relay-eu`` whatever host serves it.
- The caller's identity is the common name of its verified certificate
  (``context.auth_context()``), never a field of a message.  ``Callers`` holds the rule
  of a server: which certificate may act for which member id (an island only as
  itself, and only at its own region's relay; only relays at the aggregator).
- ``Security.insecure()`` (``--insecure``): plaintext, no identity; message fields are
  believed as they are.  Only for loopback development (``check_insecure_listen``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from hypertrain.common.errors import ConfigError
from hypertrain.common.settings import parse_address
from hypertrain.common.trust.certs import TlsFiles, cert_path
from hypertrain.wire.errors import WireError
from hypertrain.wire.options import CHANNEL_OPTIONS, tune_allocator


@dataclass(frozen=True)
class Security:
    """How a daemon's connections are secured: mutual TLS with ``files``, or plaintext."""

    files: TlsFiles | None

    @classmethod
    def tls(cls, files: TlsFiles) -> Security:
        return cls(files)

    @classmethod
    def insecure(cls) -> Security:
        return cls(None)

    @classmethod
    def of(cls, keys: Path, name: str) -> Security:
        """Mutual TLS as daemon ``name``, from a ``hypertrain keys init`` folder (its
        certificate, the key and ``ca.crt`` beside it; checked as ``TlsFiles.load`` does)."""
        return cls(TlsFiles.load(cert_path(keys, name)))

    @property
    def ca_fingerprint(self) -> str | None:
        """The run CA's fingerprint; None in plaintext."""
        return None if self.files is None else self.files.ca_fingerprint

    @property
    def name(self) -> str | None:
        """This daemon's name (its certificate's); None in plaintext."""
        return None if self.files is None else self.files.name

    def bind(self, server: grpc.Server, host_port: str) -> int:
        """Add a port for "HOST:PORT" (TLS requiring client certificates, or plaintext);
        the bound port, 0 if it could not be bound."""
        if self.files is None:
            return server.add_insecure_port(host_port)
        creds = grpc.ssl_server_credentials(
            [(self.files.key_pem, self.files.cert_pem)],
            root_certificates=self.files.ca_pem,
            require_client_auth=True,
        )
        return server.add_secure_port(host_port, creds)

    def channel(self, address: str, peer: str) -> grpc.Channel:
        """A channel to "HOST:PORT", which must be daemon ``peer`` (its certificate's
        name); it connects at the first call."""
        tune_allocator()
        if self.files is None:
            return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        creds = grpc.ssl_channel_credentials(
            root_certificates=self.files.ca_pem,
            private_key=self.files.key_pem,
            certificate_chain=self.files.cert_pem,
        )
        options = [*CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", peer)]
        return grpc.secure_channel(address, creds, options=options)


PLAINTEXT = Security.insecure()
"""No TLS: what in-process tests and benchmarks on loopback use."""


def peer_name(context: grpc.ServicerContext) -> str | None:
    """The common name of the caller's verified certificate; None without TLS."""
    auth = context.auth_context()
    names = auth.get("x509_common_name") or ()
    return names[0].decode("utf-8", "replace") if names else None


def caller_key(context: grpc.ServicerContext) -> str:
    """Who a call is from, for per-caller limits: its certificate's name, or in
    plaintext its connection's address (one per connection: nothing better is known)."""
    return peer_name(context) or context.peer()


class Callers:
    """Which certificate may act for which member id at one server."""

    def __init__(self, security: Security, names: Mapping[str, str]) -> None:
        """``names``: member id -> the name its certificate must carry."""
        self.tls = security.files is not None
        self.names = dict(names)

    def check(self, context: grpc.ServicerContext, member: str, what: str) -> None:
        """PERMISSION_DENIED unless the caller's certificate is the one of ``member``
        (nothing is checked in plaintext)."""
        if not self.tls:
            return
        peer = peer_name(context)
        expected = self.names.get(member)
        if expected is None:
            raise WireError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{peer} may not {what} as {member!r}: not a member this server serves "
                f"({', '.join(sorted(self.names))})",
            )
        if peer != expected:
            raise WireError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the caller's certificate names {peer}; only {expected} may {what} as {member}",
            )


def check_insecure_listen(role: str, listen: str) -> None:
    """ConfigError unless plaintext ``listen`` is a loopback address."""
    host, _ = parse_address(listen)
    bare = host.strip("[]")
    try:
        loopback = bare == "localhost" or ipaddress.ip_address(bare).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            f"{role}: --insecure serves plaintext, so only on a loopback address "
            f"(127.0.0.1, [::1], localhost), not {listen}; give --tls-cert instead"
        )

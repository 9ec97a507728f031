"""Daemon settings: one vocabulary for the flags and the config tables of the daemons.

A config file (``--config run.toml``) holds the ``[run]`` table (common/config.py's
RunConfig, the same for every daemon of a run) and, optionally, one table of
settings per daemon kind: ``[island]``, ``[relay]``, ``[aggregator]``.  A daemon's
setting is its flag if given, else the value in its table, else the default below.

Everything is strict: an unknown top-level table, an unknown key in a daemon's
table or a value of the wrong type is refused with a ConfigError that names it::

    config run.toml: [relay]: unknown key 'listne' (known: aggregator, listen, ...)

Invariants: the classes are frozen and validate every field in ``__post_init__``
(a bad value raises ConfigError naming the field); nothing here opens a socket or
reads the environment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from hypertrain.common.config import KNOWN_TABLES, TopologyConfig, load_tables
from hypertrain.common.config import kind_of as _kind
from hypertrain.common.errors import ConfigError
from hypertrain.common.fragments import ISLAND_CALLS
from hypertrain.common.shards import parse_shard, relay_member
from hypertrain.common.trust.keys import TRUSTED_KEYS_FILE
from hypertrain.common.trust.ledger import relay_key

_LISTEN_EXAMPLE = "expected HOST:PORT, e.g. 127.0.0.1:0, 0.0.0.0:7070 or [::1]:7070"
_WANTED = {str: "a string", int: "an integer", Path: "a path (a string)", bool: "true or false"}

# The one reader of config files and its tables live in common/config.py; re-exported here
# for the daemons, which read their settings through this module.
__all__ = ["KNOWN_TABLES", "load_tables"]


def _fits(value: object, typ: type) -> bool:
    """Whether ``value`` (from TOML, a flag or a caller) is acceptable for a ``typ`` field."""
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typ is Path:
        return isinstance(value, str | Path)
    return isinstance(value, typ)


def parse_address(listen: str) -> tuple[str, int]:
    """(host, port) of "HOST:PORT" ("[v6]:PORT" for IPv6; port 0: any); ConfigError naming
    what is wrong otherwise.  The one parser of addresses (wire.server.bind uses it too)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{listen!r} is not an address: {_LISTEN_EXAMPLE}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in bare and bare == host:
        raise ConfigError(f"{listen!r}: put an IPv6 host in brackets, [::1]:7070")
    if not bare or any(c in bare for c in "[] /"):
        raise ConfigError(f"{listen!r} is not an address: {_LISTEN_EXAMPLE}")
    return host, int(port)


def check_listen(role: str, name: str, listen: str) -> None:
    """ConfigError unless ``listen`` is "HOST:PORT" ("[v6]:PORT" for IPv6; port 0: any)."""
    try:
        parse_address(listen)
    except ConfigError as e:
        raise ConfigError(f"{role}: {name} {e}") from None


def _schema(cls: type[DaemonSettings]) -> dict[str, tuple[type, bool]]:
    """name -> (value type, whether None is allowed) for each field of ``cls``, read off
    its annotations (``str``, ``int``, ``bool`` or ``Path``, each optionally ``| None``)."""
    schema: dict[str, tuple[type, bool]] = {}
    for f in dataclasses.fields(cls):
        annotation = str(f.type)
        base = annotation.removesuffix(" | None")
        kind = {"str": str, "int": int, "Path": Path, "bool": bool}[base]
        schema[f.name] = (kind, base != annotation)
    return schema


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonSettings:
    """The settings every daemon has.  Subclasses add their own and name their table."""

    TABLE: ClassVar[str] = "daemon"
    """The config table of this kind of daemon, and the word its messages start with."""

    listen: str = "127.0.0.1:0"
    """HOST:PORT to serve on (port 0: any free port; "[::1]:7070" for IPv6)."""
    state_dir: Path | None = None
    """Where state, logs and published inputs go; None: the daemon's default
    (``state_path``)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0: any free port); None: no endpoint."""
    metrics_host: str = "127.0.0.1"
    """Interface of the metrics endpoint."""
    signing_key: Path | None = None
    """This daemon's Ed25519 key (hypertrain keys init); None: nothing is signed and
    no tape is written."""
    trusted_keys: Path | None = None
    """Pinned public keys; None: trusted_keys.json beside the signing key."""
    tls_cert: Path | None = None
    """This daemon's TLS certificate (hypertrain keys init: ``<name>.crt``), naming it;
    required unless ``insecure``."""
    tls_key: Path | None = None
    """Its private key; None: ``<name>.tls.key`` beside the certificate."""
    tls_ca: Path | None = None
    """The run CA's certificate; None: ``ca.crt`` beside the certificate."""
    insecure: bool = False
    """Plaintext, no peer identity: loopback development only (a server refuses to
    listen elsewhere)."""
    calls_per_peer: int = 4
    """The most calls one caller (one certificate; in plaintext, one connection) may
    have in flight at this server; more are refused RESOURCE_EXHAUSTED."""
    call_idle_s: int = 30
    """A streaming call that moves no data for this long is ended DEADLINE_EXCEEDED."""
    call_min_kib_s: int = 256
    """A streaming call must average at least this many KiB/s after its first
    ``call_idle_s`` seconds, or it is ended DEADLINE_EXCEEDED."""
    pushes_reading: int = 2
    """Callers whose pushes this server reads the data of at once (0: no limit); a push
    past it waits after its header, first come first served, until a push has read its
    last chunk or its call ends (one slower than 8 MiB/s does not count): what a
    relay holds for its pushes then grows with its islands only by what gRPC holds of
    each one waiting."""

    def __post_init__(self) -> None:
        role = self.TABLE
        for name, (typ, optional) in _schema(type(self)).items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            if not _fits(value, typ):
                raise ConfigError(f"{role}: {name} must be {_WANTED[typ]}, got {_kind(value)}")
            if typ is Path:
                if not str(value):
                    raise ConfigError(f"{role}: {name} must not be empty")
                object.__setattr__(self, name, Path(value))
        check_listen(role, "listen", self.listen)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"{role}: metrics_port must be in [0, 65535], got {self.metrics_port}"
            )
        for name in ("calls_per_peer", "call_idle_s", "call_min_kib_s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{role}: {name} must be >= 1, got {getattr(self, name)}")
        if self.pushes_reading < 0:
            raise ConfigError(f"{role}: pushes_reading must be >= 0, got {self.pushes_reading}")
        if self.insecure and self.tls_cert is not None:
            raise ConfigError(f"{role}: give tls_cert (--tls-cert) or insecure, not both")
        if not self.metrics_host or any(c.isspace() or c == "/" for c in self.metrics_host):
            raise ConfigError(f"{role}: metrics_host {self.metrics_host!r} is not a host name")
        self._validate()

    def _validate(self) -> None:
        """The subclass's own checks (a hook: zero-argument super() fails in slots classes)."""

    # -- derived values ---------------------------------------------------------------
    def _default_state_dir(self) -> str:
        return self.TABLE

    @property
    def state_path(self) -> Path:
        """``state_dir``, or the daemon's default when it is not set."""
        return self.state_dir if self.state_dir is not None else Path(self._default_state_dir())

    @property
    def trusted_keys_path(self) -> Path | None:
        """``trusted_keys``, or trusted_keys.json beside the signing key; None if unsigned."""
        if self.trusted_keys is not None:
            return self.trusted_keys
        if self.signing_key is None:
            return None
        return self.signing_key.parent / TRUSTED_KEYS_FILE

    # -- construction -----------------------------------------------------------------
    @classmethod
    def field_types(cls) -> dict[str, type]:
        """Each setting's name and its value type (str, int or Path), in field order."""
        return {name: typ for name, (typ, _) in _schema(cls).items()}

    @classmethod
    def resolve(
        cls,
        table: Mapping[str, Any],
        flags: Mapping[str, Any] | None = None,
        *,
        source: str | Path | None = None,
    ) -> Self:
        """The settings from this kind's config table and flags (a flag wins; None
        means not given).  ``source``: the config file, named in messages.

        ConfigError for a key of ``table`` that is not a setting or whose value has
        the wrong type (naming the key and the table); TypeError for an unknown flag
        name (a caller's mistake, not the user's)."""
        where = f"[{cls.TABLE}]" if source is None else f"config {source}: [{cls.TABLE}]"
        types = cls.field_types()
        unknown = sorted(set(table) - set(types))
        if unknown:
            names = ", ".join(repr(k) for k in unknown)
            raise ConfigError(
                f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {names} "
                f"(known: {', '.join(sorted(types))})"
            )
        flags = flags or {}
        bad_flags = sorted(set(flags) - set(types))
        if bad_flags:
            raise TypeError(f"{cls.__name__}.resolve: not a setting: {', '.join(bad_flags)}")
        values: dict[str, Any] = {}
        for key, value in table.items():
            typ = types[key]
            if not _fits(value, typ):
                raise ConfigError(
                    f"{where}: key {key!r} must be {_WANTED[typ]}, got {_kind(value)} ({value!r})"
                )
            values[key] = value
        values.update({k: v for k, v in flags.items() if v is not None})
        return cls(**values)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSettings(DaemonSettings):
    """What the daemons that keep a tape, inputs and checkpoints (relays and the
    aggregator) have beside the shared settings."""

    keep_rounds: int = 0
    """Keep the checkpoints of this many global rounds, the newest, and the published
    inputs taped after the oldest of them; delete the rest after each round (0: keep every
    round, so the whole run can be audited; else at least common/rounds/store.py's
    MIN_KEEP_ROUNDS).  The tape is kept
    whole; the run is then auditable from the oldest round every node kept."""

    def _validate(self) -> None:
        from hypertrain.common.rounds.store import check_keep_rounds  # (torch: only here)

        try:
            check_keep_rounds(self.keep_rounds)
        except ConfigError as e:
            raise ConfigError(f"{self.TABLE}: {e}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class AggregatorSettings(NodeSettings):
    """hypertrain-aggregator: the shared settings only (state_dir default: ``aggregator``)."""

    TABLE: ClassVar[str] = "aggregator"


@dataclass(frozen=True, kw_only=True, slots=True)
class RelaySettings(NodeSettings):
    """hypertrain-relay: one region's relay (state_dir default: ``relay-<region>``)."""

    TABLE: ClassVar[str] = "relay"

    region: str | None = None
    """The region this relay serves (one of the run's topology.regions); required."""
    aggregator: str | None = None
    """HOST:PORT of the aggregator; required."""
    shard: str | None = None
    """"i/S": this process is shard i of the region's S relay shards (S must be the run's
    topology.relay_shards); required when S > 1 (common/shards.py)."""
    cut_through: bool = True
    """Serve each global merge to the islands while it arrives from the aggregator
    (services/wire/cutthrough.py); false: only once it arrived whole and was applied."""

    def _default_state_dir(self) -> str:
        """``relay-<region>``, or ``relay-<region>-<i>`` for shard i of S > 1."""
        i, count = (0, 1) if self.shard is None else parse_shard(self.shard)
        return relay_key(relay_member(str(self.region), i, count))

    def shard_index(self, topology: TopologyConfig) -> int:
        """Which shard of its region's relay this process is (0 when not sharded);
        ConfigError unless ``--shard i/S`` agrees with the run's relay_shards."""
        count = topology.relay_shards
        if self.shard is None:
            if count > 1:
                raise ConfigError(f"--shard i/S is required: this run's relays have {count} shards")
            return 0
        i, s = parse_shard(self.shard)
        if s != count:
            raise ConfigError(
                f"--shard {self.shard}: this run's relays have {count} shard(s) "
                "(--relay-shards / topology.relay_shards)"
            )
        return i

    def check_topology(self, topology: TopologyConfig) -> tuple[str, str]:
        """(region, aggregator); ConfigError unless the region is one of the run's and
        the aggregator is set."""
        if not self.region or self.region not in topology.regions:
            raise ConfigError(
                f"--region must be one of {', '.join(topology.regions)}, got {self.region!r}"
            )
        if not self.aggregator:
            raise ConfigError("--aggregator HOST:PORT is required")
        return self.region, self.aggregator

    def check_fragments(self, fragments: int) -> None:
        """ConfigError when an island of a run of ``fragments`` streaming fragments may make
        more calls at once than ``calls_per_peer`` lets it (``fragments.ISLAND_CALLS``)."""
        need = min(fragments, ISLAND_CALLS)
        if self.calls_per_peer < need:
            raise ConfigError(
                f"relay: calls_per_peer {self.calls_per_peer} is below the {need} calls an "
                f"island of a run with {fragments} fragments makes at once (its fragments' "
                f"pushes at the last step); give at least {need}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class IslandSettings(DaemonSettings):
    """hypertrain-island: one island (state_dir default: ``island-<region>-<index>``).
    An island serves nothing: ``listen`` is accepted and unused."""

    TABLE: ClassVar[str] = "island"

    region: str | None = None
    """The island's region (one of the run's topology.regions); required."""
    index: int = 0
    """The island's index in its region, in [0, topology.islands_per_region)."""
    relay: str | None = None
    """HOST:PORT of the region's relay; required.  With relay shards, every shard's
    address in shard order, comma-separated."""
    device: str = "cpu"
    """Where to train: "cpu" or "cuda" (under torchrun, cuda means cuda:LOCAL_RANK)."""

    def _validate(self) -> None:
        if self.index < 0:
            raise ConfigError(f"island: index must be >= 0, got {self.index}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"island: device must be 'cpu' or 'cuda', got {self.device!r}")

    @property
    def island_id(self) -> str:
        """``<region>-<index>``, e.g. eu-0."""
        return f"{self.region}-{self.index}"

    def _default_state_dir(self) -> str:
        return f"island-{self.island_id}"

    def check_topology(self, topology: TopologyConfig) -> tuple[str, str]:
        """(region, relay); ConfigError unless region and index name an island of the
        run and the relay is set."""
        if not self.region or self.region not in topology.regions:
            raise ConfigError(
                f"--region must be one of {', '.join(topology.regions)}, got {self.region!r}"
            )
        if not self.index < topology.islands_per_region:
            raise ConfigError(
                f"--index must be in [0, {topology.islands_per_region}), got {self.index}"
            )
        if not self.relay:
            raise ConfigError("--relay HOST:PORT is required")
        return self.region, self.relay

    def relays(self, topology: TopologyConfig) -> list[str]:
        """The relay addresses, one per relay shard in shard order (ConfigError unless
        there are exactly topology.relay_shards)."""
        addresses = [a.strip() for a in (self.relay or "").split(",")]
        if len(addresses) != topology.relay_shards or not all(addresses):
            raise ConfigError(
                f"--relay: {len(addresses)} address(es) for {topology.relay_shards} relay "
                "shard(s); give every shard's HOST:PORT in shard order, comma-separated"
            )
        return addresses

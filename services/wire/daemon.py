"""What every daemon shares: logfmt log lines, config loading, durable small files.

Settings (common/settings.py): a flag if given, else the daemon's table of the
``--config`` file (``[island]``, ``[relay]``, ``[aggregator]``), else the default;
unknown tables, keys and mistyped values are refused (:func:`load_settings`).

Log lines go to stdout, one per event, as logfmt so that both a person and
``hypertrain up`` read them::

    event=round role=relay region=eu round=3 step=40 members=eu-0,eu-1 bytes=242688 ts=2026-12-05T09:41:02.125Z

``ts``, last on every line, is when the line was written (UTC, milliseconds): a sync's
way through an island, its relay and the aggregator can be followed across their logs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import datetime as dt
import gc
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch

from hypertrain.common.config import RunConfig
from hypertrain.common.errors import ConfigError
from hypertrain.common.flat import ParamLayout
from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.store import Pruned, Swept
from hypertrain.common.runflags import add_run_config_flags, run_config_from_args
from hypertrain.common.settings import DaemonSettings, load_tables
from hypertrain.common.trust.certs import TlsFiles
from hypertrain.common.trust.keys import SigningKey, TrustedKeys, load_signing_key
from hypertrain.wire.calls import CallGuard, CallLimits
from hypertrain.wire.lines import write_line
from hypertrain.wire.metrics import Metrics, announce_metrics
from hypertrain.wire.options import trim_heap
from hypertrain.wire.tls import Security, check_insecure_listen


def _fmt(value: object) -> str:
    text = str(value)  # floats: shortest round-trip repr, so logs carry exact values
    if not text or any(c in text for c in ' "='):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def log_time(now: float | None = None) -> str:
    """The ``ts`` of a log line: UTC, RFC 3339 to the millisecond (``now``: a Unix time;
    default the clock now)."""
    when = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def die(role: str, reason: str, **where: object) -> NoReturn:
    """End this process at once with exit code 1, after an ``event=stopped`` line naming
    ``reason``: a node whose store failed after its machine decided may hold live state
    its tape does not, so no thread may tape or serve anything more.  The same as a kill
    at the caller's line, which every node recovers from (its tape, on restart)."""
    try:
        with contextlib.suppress(BaseException):  # a broken stdout must not keep it alive
            log_event(
                "stopped",
                **{**where, "role": role, "failed": True, "reason": " ".join(reason.split())},
            )
            sys.stderr.flush()
    finally:
        os._exit(1)


@contextlib.contextmanager
def durable_or_die(role: str, what: str, **where: object) -> Iterator[None]:
    """Around a node's step that writes its store after its machine decided (a push, a
    join or leave, a cutoff, a relay's global update): refusals are decisions, not
    exceptions, so any exception there is the store failing, and the process ends
    (``die``) saying that ``what`` could not be made durable.  Called holding the node's
    lock, it ends the process still holding it."""
    try:
        yield
    except Exception as e:
        die(role, f"{what} could not be made durable: {e!r}", **where)


def log_event(event: str, **fields: object) -> None:
    """Print one logfmt line (``event=... k=v ... ts=...``) to stdout and flush it; ``ts``,
    last, is when it was written (``log_time``), so lines of several daemons can be put
    on one time line."""
    items = [f"event={event}"] + [f"{k}={_fmt(v)}" for k, v in fields.items()]
    write_line(" ".join([*items, f"ts={log_time()}"]))


_STATUS_FIELDS = {"VmRSS": "rss_mib", "RssAnon": "anon_mib", "VmHWM": "peak_mib"}


def memory_fields() -> dict[str, int]:
    """This process's memory for a log line, in MiB: resident (``rss_mib``), of it the
    anonymous part (``anon_mib``: the heap, tensors, buffers; the rest is mapped files)
    and the peak resident so far (``peak_mib``), from /proc/self/status; {} where there
    is none.  Logged at each round so an operator sees which phase holds what."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in _STATUS_FIELDS:
            out[_STATUS_FIELDS[key]] = int(rest.split()[0]) >> 10  # kB -> MiB
    return out


def daemon_parser(role: str, doc: str) -> argparse.ArgumentParser:
    """An argument parser with ``--config``, the run-config flags, ``--listen`` and ``--state-dir``."""
    p = argparse.ArgumentParser(prog=f"hypertrain-{role}", description=doc)
    add_run_config_flags(p)
    p.add_argument("--listen", help="HOST:PORT to serve on (port 0: any free port)")
    p.add_argument("--state-dir", type=Path, help="where state, logs and published inputs go")
    p.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free port)"
    )
    p.add_argument("--metrics-host", help="interface of the metrics endpoint (default 127.0.0.1)")
    p.add_argument(
        "--signing-key",
        type=Path,
        help="this daemon's Ed25519 key (hypertrain keys init); without it nothing is signed "
        "and no tape is written",
    )
    p.add_argument(
        "--trusted-keys",
        type=Path,
        help="pinned public keys (default: trusted_keys.json beside the signing key)",
    )
    tls = p.add_argument_group("transport security (mutual TLS)")
    tls.add_argument(
        "--tls-cert",
        type=Path,
        help="this daemon's certificate (hypertrain keys init: DIR/<name>.crt); its key "
        "and the run CA are read from beside it unless given",
    )
    tls.add_argument("--tls-key", type=Path, help="default: <name>.tls.key beside the cert")
    tls.add_argument("--tls-ca", type=Path, help="the run CA (default: ca.crt beside the cert)")
    tls.add_argument(
        "--insecure",
        action="store_const",
        const=True,
        help="plaintext without identities, for development on loopback only",
    )
    tls.add_argument(
        "--calls-per-peer", type=int, help="calls one peer may have in flight (default 4)"
    )
    tls.add_argument(
        "--call-idle-s",
        type=int,
        help="end a streaming call that moves nothing for this long (default 30)",
    )
    tls.add_argument(
        "--call-min-kib-s",
        type=int,
        help="end a streaming call slower than this on average (default 256 KiB/s)",
    )
    tls.add_argument(
        "--pushes-reading",
        type=int,
        help="callers whose pushes this server reads at once; others wait their turn after "
        "their header (default 2; 0: no limit)",
    )
    return p


def add_store_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a daemon that keeps a tape, inputs and checkpoints (relay, aggregator)."""
    p.add_argument(
        "--keep-rounds",
        type=int,
        metavar="K",
        help="keep the checkpoints of the K newest global rounds (at least 2) and the "
        "published inputs taped after the oldest of them, and delete the rest; the tape "
        "stays whole and the run is auditable from the oldest round kept (default 0: keep "
        "every round)",
    )


def log_pruned(role: str, where: dict[str, object]) -> Callable[[Pruned], None]:
    """A NodeStore's ``on_prune``: one ``event=pruned`` line per prune, or a warning
    naming the file it could not read or delete (the round is durable either way)."""

    def log(p: Pruned) -> None:
        if p.trash_error:  # the deletes of an earlier prune, tried again now
            log_event("warning", role=role, **where, message=p.trash_error)
        if p.error:
            log_event("warning", role=role, **where,
                      message=f"pruning rounds before {p.kept_from} stopped short: {p.error}")  # fmt: skip
            return
        log_event("pruned", role=role, **where, kept_from_round=p.kept_from,
                  checkpoints=p.checkpoints, inputs=p.inputs, bytes=p.bytes)  # fmt: skip

    return log


def log_swept(role: str, where: dict[str, object]) -> Callable[[Swept], None]:
    """A NodeStore's ``on_sweep``: one ``event=swept`` line for what a process that died
    mid-write left (temp files, an input published but never taped), and a warning for
    untaped inputs it left where they are or a file it could not move."""

    def log(s: Swept) -> None:
        if s.files:
            log_event("swept", role=role, **where, files=s.files, bytes=s.bytes)
        if s.untaped_kept:
            log_event("warning", role=role, **where, message=(
                f"{s.untaped_kept} published inputs no tape entry names were left in place "
                "(more than a crash leaves, or a tape begun on an older folder)"))  # fmt: skip
        if s.error:
            log_event("warning", role=role, **where, message=f"sweeping: {s.error}")

    return log


S = TypeVar("S", bound=DaemonSettings)


def load_settings(args: argparse.Namespace, cls: type[S]) -> S:
    """The daemon's settings: its flags over the ``[<role>]`` table of ``--config``.

    ConfigError (one line naming the key, table or file) for an unreadable config, an
    unknown top-level table, an unknown key in the daemon's table or a mistyped value."""
    tables = load_tables(args.config) if args.config else {}
    flags = {name: getattr(args, name, None) for name in cls.field_types()}
    return cls.resolve(tables.get(cls.TABLE, {}), flags, source=args.config)


def load_identity(settings: DaemonSettings) -> tuple[SigningKey | None, TrustedKeys | None]:
    """The daemon's signing key and the keys it trusts, or (None, None) when unsigned."""
    trusted = settings.trusted_keys_path  # None exactly when there is no signing key
    if settings.signing_key is None or trusted is None:
        log_event(
            "warning", role=settings.TABLE, message="no --signing-key: deltas unsigned, no tape"
        )
        return None, None
    return load_signing_key(settings.signing_key), TrustedKeys.load(trusted)


def load_security(settings: DaemonSettings, name: str, metrics: Metrics) -> Security:
    """Mutual TLS with the daemon's certificate, which must name it (``name``:
    island-eu-0, relay-eu, aggregator), or plaintext with ``insecure`` (a server then
    only on loopback); ConfigError / KeyFileError naming the problem otherwise.  Logs
    when the certificate expires (a warning within ``EXPIRY_WARNING_DAYS``) and exports
    it (``hypertrain_tls_cert_expiry_timestamp_seconds``)."""
    role = settings.TABLE
    if settings.insecure:
        if role != "island":  # an island serves nothing
            check_insecure_listen(role, settings.listen)
        log_event("warning", role=role, message="--insecure: plaintext, peers not identified")
        return Security.insecure()
    if settings.tls_cert is None:
        raise ConfigError(
            "no TLS certificate: give --tls-cert DIR/<name>.crt (hypertrain keys init makes "
            "one per daemon) or --insecure for plaintext on loopback"
        )
    files = TlsFiles.load(settings.tls_cert, settings.tls_key, settings.tls_ca)
    if files.name != name:
        raise ConfigError(f"certificate {settings.tls_cert} names {files.name}, not {name}")
    left = files.not_after - dt.datetime.now(dt.UTC)
    soon = left <= dt.timedelta(days=EXPIRY_WARNING_DAYS)
    rotate = {"message": "TLS certificate expires soon: hypertrain keys cert DIR NAME"}
    log_event(
        "warning" if soon else "tls",
        role=role,
        name=name,
        expires=f"{files.not_after:%Y-%m-%dT%H:%M:%SZ}",
        days_left=left.days,
        **(rotate if soon else {}),
    )
    metrics.cert_expiry.labels(metrics.role).set(files.not_after.timestamp())
    return Security.tls(files)


#: A daemon whose certificate expires within this many days says so at start (warning).
EXPIRY_WARNING_DAYS = 30


def call_guard(settings: DaemonSettings, metrics: Metrics, parts: int = 1) -> CallGuard:
    """The bounds on the daemon's calls (``calls.py``) from its settings, counted in
    ``hypertrain_calls_refused_total``.  ``parts``: independent parts each caller talks to
    at once (the aggregator of a run in F streaming fragments: a relay forwards and
    fetches every fragment's rounds side by side), each allowed ``calls_per_peer``."""
    limits = CallLimits(
        per_peer=settings.calls_per_peer * parts,
        idle_s=float(settings.call_idle_s),
        min_bytes_s=settings.call_min_kib_s * 1024.0,
        reading=settings.pushes_reading,
    )
    refused = metrics.calls_refused
    for reason in ("per_peer", "idle", "slow"):  # exported at 0 from the start
        refused.labels(metrics.role, reason)
    waiting = metrics.pushes_waiting.labels(metrics.role)
    return CallGuard(
        limits,
        on_refused=lambda reason: refused.labels(metrics.role, reason).inc(),
        on_waiting=waiting.set,
    )


def start_metrics(settings: DaemonSettings, metrics: Metrics) -> None:
    """Serve ``metrics`` if ``--metrics-port`` (or the config's metrics_port) is set."""
    if settings.metrics_port is None:
        return
    announce_metrics(metrics.role, metrics.serve(settings.metrics_port, settings.metrics_host))


def load_run_config(args: argparse.Namespace) -> RunConfig:
    return run_config_from_args(args)


_FAULT: list[Any] = []


def starting_parameters(cfg: RunConfig) -> tuple[ParamLayout, torch.Tensor]:
    """The run's initial parameters (``roles.initial_parameters``), with the heap given
    back while they are copied out of the model built to draw them: its tensors sit in
    the heap, and glibc keeps freed pages there (measured at P = 1e8: a relay held 1.1 m
    more for the whole run without a trim, and trimming only at the end still held the
    model and the flat copy together, 2 m, at start)."""
    layout, theta0 = initial_parameters(cfg, release=trim_heap)
    trim_heap()
    return layout, theta0


def freeze_heap() -> None:
    """Once a daemon has started (its imports, the model, its node recovered): every
    object made so far leaves the cyclic collector's reach (``gc.freeze``).  They live as
    long as the process; without this, each full collection (the transfers' allocations,
    a few Python objects per 1 MiB message, trigger several a round) walked all of them
    again.  Garbage made later is collected as before."""
    gc.collect()
    gc.freeze()


def fault_point(name: str) -> None:
    """Crash-test hook: ``HYPERTRAIN_FAULT=<name>:<n>`` SIGKILLs this process the n-th
    time it passes point ``name`` (1-based); ``<name>:<n>:stop`` SIGSTOPs it there
    instead (a test resumes it with SIGCONT: a stall at an exact point).  Unset
    (always, outside tests): a no-op."""
    if not _FAULT:
        spec = os.environ.get("HYPERTRAIN_FAULT", "")
        point, _, rest = spec.partition(":")
        count, _, action = rest.partition(":")
        if action not in ("", "kill", "stop"):
            raise ValueError(f"HYPERTRAIN_FAULT {spec!r}: the action must be kill or stop")
        _FAULT.extend([point, int(count or 0), 0, action or "kill"])
    if _FAULT[0] != name:
        return
    _FAULT[2] += 1
    if _FAULT[2] == _FAULT[1]:
        os.kill(os.getpid(), signal.SIGSTOP if _FAULT[3] == "stop" else signal.SIGKILL)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux only).

    For children whose parent may be killed outright: ``up``'s daemons, and the ranks
    of an island under torchrun (a rank blocked in a collective never runs its
    SIGTERM handler, so an orphaned rank would wait there for an hour)."""
    if _LIBC is not None:
        with contextlib.suppress(AttributeError):  # no prctl: not Linux
            _LIBC.prctl(1, int(sig))  # PR_SET_PDEATHSIG


def _load_libc() -> ctypes.CDLL | None:
    # Loaded once at import: die_with_parent also runs between fork and exec, where
    # find_library (which may start ldconfig) must not.
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def fail(role: str, message: str, code: int = 2) -> int:
    """Print ``hypertrain-<role>: error: <message>`` to stderr; return ``code``."""
    print(f"hypertrain-{role}: error: {message}", file=sys.stderr, flush=True)
    return code

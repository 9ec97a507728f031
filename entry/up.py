"""``hypertrain up``: the whole system as separate processes on loopback.

Starts one aggregator, one relay per region (or ``--relay-shards S`` relay processes
per region, each owning a range of the parameters) and every island as separate OS
processes (``python -m hypertrain.<role>``) bound to 127.0.0.1 port 0, shows
live progress from their logs, and ends with a summary.  It stops every
process it started when the run ends, when it is interrupted, and when any of
them fails (showing that process's last log lines); it exits non-zero then.

Run folder (``--run-dir``, default ``runs/<run_id>-<UTC time>``): ``run.toml``
(the resolved config), ``logs/<daemon>.log``, ``aggregator/`` (state.pt and
published inputs), ``relay-<region>/`` (shards: ``relay-<region>-<i>/``), ``scrape_targets.json`` (the daemons' metrics
endpoints, a Prometheus file_sd list); with ``--prometheus`` also ``prometheus/`` (its
config, rules and storage: entry/prom.py).

``--chaos SEED`` (entry/chaos_up.py): the same cluster, with islands killed, restarted,
stopped and one added mid-run at seeded steps; it ends with what chaos did, the members
of every round from the tapes, the cutoffs' timing and the audit's verdict.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import threading
import time
from collections.abc import Callable, Collection, Container, Mapping
from pathlib import Path
from typing import Any

from hypertrain.chaos_up import (
    ChaosPlan,
    ChaosRunner,
    audit_line,
    cutoff_lines,
    members_lines,
    plan_chaos,
)
from hypertrain.common.config import RunConfig
from hypertrain.common.errors import HypertrainError
from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.store import FRAGMENT_DIR, check_keep_rounds
from hypertrain.common.runflags import run_config_from_args
from hypertrain.common.shards import relay_member
from hypertrain.common.trust.certs import cert_path, ensure_certs
from hypertrain.common.trust.keys import TrustedKeys, daemon_key_names, init_keys
from hypertrain.common.trust.ledger import relay_key
from hypertrain.procs import Child, child_env, python_module, torchrun
from hypertrain.prom import PromHandle, start_prometheus

ISLAND_NICE = 5


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def config_toml(cfg: RunConfig) -> str:
    """The ``[run]`` table of ``cfg`` as TOML (nested tables for topology/inner/outer)."""
    flat, nested = [], []
    for key, value in cfg.to_dict().items():
        if isinstance(value, dict):
            nested.append(
                f"\n[run.{key}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in value.items())
            )
        elif value is not None:
            flat.append(f"{key} = {toml_value(value)}\n")
    return "[run]\n" + "".join(flat) + "".join(nested)


class Progress:
    """Collects daemon events; prints one line per global round."""

    def __init__(self, cfg: RunConfig, quiet: bool = False) -> None:
        self.cfg = cfg
        self.quiet = quiet
        self.lock = threading.Lock()
        self.evals: dict[int, float] = {}
        self.done: dict[str, dict[str, str]] = {}
        self.final_digest: str | None = None
        self.lawa: dict[str, str] | None = None
        """The aggregator's ``event=lawa`` (RunConfig.lawa): the average's rounds and digest."""
        self.rounds = cfg.steps // cfg.topology.h_g
        self.t0 = time.monotonic()
        self.watchers: list[Callable[[str, dict[str, str]], None]] = []
        """Also handed every event (after it is counted here): ``--chaos`` watches syncs."""

    def on_event(self, source: str, e: dict[str, str]) -> None:
        self._count(e)
        for watch in self.watchers:
            watch(source, e)

    def _count(self, e: dict[str, str]) -> None:
        with self.lock:
            kind = e["event"]
            if kind == "eval":
                step = int(e["step"])
                self.evals[step] = float(e["heldout_loss"])
                if not self.quiet:
                    r = int(e["round"]) + 1
                    label = "start" if step == 0 else f"round {r:3d}/{self.rounds}"
                    print(
                        f"  {label:>14s}  step {step:5d}  held-out loss {self.evals[step]:.4f}"
                        f"  ({time.monotonic() - self.t0:5.1f}s)",
                        flush=True,
                    )
            elif kind == "done":
                self.done[e["island"]] = e
            elif kind == "final" and "digest" in e:
                self.final_digest = e["digest"]
            elif kind == "lawa" and "digest" in e:
                self.lawa = {**(self.lawa or {}), **e}
            elif kind == "eval_lawa":
                self.lawa = {**(self.lawa or {}), "heldout_loss": e["heldout_loss"]}


def identity_flags(keys: Path, name: str) -> tuple[str, ...]:
    """The flags that give daemon ``name`` its signing key and TLS certificate from the
    key folder ``keys`` (``hypertrain keys init``)."""
    return ("--signing-key", str(keys / f"{name}.key"), "--tls-cert", str(cert_path(keys, name)))


def _spawn(
    run_dir: Path,
    name: str,
    module: str,
    args: tuple[str, ...],
    progress: Progress,
    env: dict[str, str],
    *,
    label: str | None = None,
    nice: int = 0,
    ranks: int = 1,
) -> Child:
    """One daemon of the run in ``run_dir`` with the signing key ``keys/<name>.key`` and
    the TLS certificate ``keys/<name>.crt``; ``label`` (default ``name``): the child's
    name and its log's, ``logs/<label>.log``."""
    conf = run_dir / "run.toml"
    flags = (
        "--config",
        str(conf),
        "--metrics-port",
        "0",
        *identity_flags(run_dir / "keys", name),
        *args,
    )
    argv = python_module(module, *flags) if ranks == 1 else torchrun(ranks, module, *flags)
    label = label or name
    return Child(label, argv, run_dir / "logs" / f"{label}.log", progress.on_event, env, nice=nice)


def start_island(
    run_dir: Path,
    progress: Progress,
    island: str,
    relay: str,
    env: dict[str, str] | None = None,
    *,
    label: str | None = None,
    ranks: int = 1,
    device: str = "cpu",
) -> Child:
    """Start island ``island`` (``eu-1``) of the run in ``run_dir`` against ``relay`` (its
    region's relay addresses, comma-separated), with its state in ``island-<id>/``: a
    restart of an island resumes from there.  ``label``: its child and log name
    (default ``island-<id>``; a restart needs another, so that its log is a new file)."""
    region, _, index = island.rpartition("-")
    # On one shared host the islands' training saturates every core; a lower
    # priority lets relays and the aggregator answer at once (each sync waits on them).
    return _spawn(
        run_dir,
        f"island-{island}",
        "hypertrain.island",
        (
            *("--region", region, "--index", index, "--relay", relay),
            *("--state-dir", str(run_dir / f"island-{island}")),
            *(("--device", device) if device != "cpu" else ()),
        ),
        progress,
        env if env is not None else child_env(),
        label=label,
        nice=ISLAND_NICE,
        ranks=ranks,
    )


def relay_addresses(children: list[Child]) -> dict[str, str]:
    """Each region's relay addresses (its shards', comma-separated in shard order), as an
    island's ``--relay`` takes them, from the started children."""
    relays: dict[str, list[str]] = {}
    for c in children:
        role, _, rest = c.name.partition("-")
        if role == "relay" and c.address is not None:
            relays.setdefault(rest.partition("-")[0], []).append(c.address)
    return {region: ",".join(addrs) for region, addrs in relays.items()}


def start_cluster(
    cfg: RunConfig,
    run_dir: Path,
    progress: Progress,
    extra_env: dict[str, str] | None = None,
    island_ranks: Mapping[str, int] | None = None,
    env_of: Mapping[str, dict[str, str]] | None = None,
    hold: Collection[str] = (),
    island_device: str = "cpu",
    keep_rounds: int = 0,
) -> list[Child]:
    """Start aggregator, relays and islands; returns them in start order.

    ``env_of``: more environment for the child of that name (``island-eu-1``: a fault
    point that one island only passes).

    ``island_ranks`` maps island ids to a number of data-parallel ranks: those
    islands run under ``torchrun --standalone --nproc-per-node K`` (gloo on the CPU).

    ``hold``: islands not started (``start_island`` starts them later: ``--chaos``).
    ``island_device``: where the islands train (``cuda``: NCCL between an island's ranks).
    ``keep_rounds``: the relays' and the aggregator's ``--keep-rounds`` (0: every round).
    """
    keys = run_dir / "keys"
    names = daemon_key_names(cfg.topology)
    if not (keys / "trusted_keys.json").exists():
        init_keys(keys, names)
    ensure_certs(keys, names)  # a run folder from before TLS has keys only
    env = child_env() | (extra_env or {})
    children: list[Child] = []
    keep = ("--keep-rounds", str(keep_rounds)) if keep_rounds else ()

    def own(name: str) -> dict[str, str]:
        return env | (env_of or {}).get(name, {})

    agg = _spawn(
        run_dir,
        "aggregator",
        "hypertrain.aggregator",
        ("--listen", "127.0.0.1:0", "--state-dir", str(run_dir / "aggregator"), *keep),
        progress,
        own("aggregator"),
    )
    children.append(agg)
    agg_addr = agg.wait_listening()
    relays: list[Child] = []
    count = cfg.topology.relay_shards
    for region in sorted(cfg.topology.regions):
        for i in range(count):  # one relay per region, or its shards (--relay-shards)
            name = relay_key(relay_member(region, i, count))
            args = (
                *("--region", region, "--aggregator", agg_addr, "--listen", "127.0.0.1:0"),
                *(("--shard", f"{i}/{count}") if count > 1 else ()),
                *("--state-dir", str(run_dir / name)),
                *keep,
            )
            relays.append(_spawn(run_dir, name, "hypertrain.relay", args, progress, own(name)))
    children.extend(relays)
    for c in relays:
        c.wait_listening()
    addrs = relay_addresses(relays)
    for island in cfg.topology.island_ids():
        if island in hold:
            continue
        region = cfg.topology.region_of(island)
        children.append(
            start_island(
                run_dir,
                progress,
                island,
                addrs[region],
                own(f"island-{island}"),
                ranks=(island_ranks or {}).get(island, 1),
                device=island_device,
            )
        )
    return children


def write_scrape_targets(children: list[Child], path: Path, timeout_s: float = 60.0) -> int:
    """Prometheus file_sd targets of every child's metrics endpoint; returns their count."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
        c.metrics_url is None and c.proc.poll() is None for c in children
    ):
        time.sleep(0.05)
    groups = []
    for c in children:
        if c.metrics_url:
            hostport = c.metrics_url.removeprefix("http://").removesuffix("/metrics")
            role, _, rest = c.name.partition("-")
            labels = {"job": f"hypertrain-{role}", "daemon": c.name}
            if role == "relay":  # relay-eu, or a shard: relay-eu-1
                labels["region"] = rest.partition("-")[0]
            elif role == "island":
                labels["island"] = rest
                labels["region"] = rest.rpartition("-")[0]
            groups.append({"targets": [hostport], "labels": labels})
    path.write_text(json.dumps(groups, indent=2) + "\n")
    return len(groups)


def supervise(
    children: list[Child],
    poll_s: float = 0.2,
    deadline_s: float | None = None,
    expected: Container[Child] = (),
    busy: Callable[[], bool] | None = None,
) -> Child | None:
    """Wait until every child exits 0 (None) or one fails (that child).

    ``children`` may grow while this waits (a restarted island).  ``expected``: children
    whose exit is no failure whatever its code (killed on purpose by ``--chaos``; add one
    before killing it).  ``busy()`` true: more children are to come, so the run is not
    over even when none is running.

    With ``deadline_s``, a run still going after that long raises TimeoutError.  It
    returns once the exited children's output is read to its end (``Child.drain``; at
    most 5 s each, a warning naming a child whose output stays open longer)."""
    t_end = None if deadline_s is None else time.monotonic() + deadline_s
    while True:
        if t_end is not None and time.monotonic() > t_end:
            raise TimeoutError(f"run still going after {deadline_s:.0f}s")
        running = False
        for child in list(children):
            code = child.proc.poll()
            if code is None:
                running = True
            elif code != 0 and child not in expected:
                child.drain()  # its last lines, for the failure message
                return child
        if not running and not (busy is not None and busy()):
            for child in children:  # every last line (a "done", a final error) handled
                if not child.drain():
                    print(
                        f"hypertrain up: {child.name} exited, but its output is still open "
                        "after 5 s (a process it started may still hold it)",
                        file=sys.stderr,
                        flush=True,
                    )
            return None
        time.sleep(poll_s)


def summary(cfg: RunConfig, progress: Progress, run_dir: Path, wall: float) -> tuple[str, bool]:
    layout, _ = initial_parameters(cfg)
    fp32 = 4 * layout.numel
    done = progress.done
    kept = cfg.anneal_kept()
    stopped = {i: e for i, e in done.items() if kept is not None and i not in kept}
    digests = {e["digest"] for i, e in done.items() if i not in stopped}
    per_sync = sum(int(e["bytes_per_sync"]) for e in done.values()) / max(len(done), 1)
    blocked = max((float(e["blocked_share"]) for e in done.values()), default=0.0)
    # The initial state's evaluation is skipped when the aggregator's second outer step
    # comes first (it holds no older state than the one it steps from): the earliest.
    start = min(progress.evals, default=0)
    first = progress.evals.get(start, float("nan"))
    last = progress.evals.get(cfg.steps, float("nan"))
    agree = len(digests) == 1 and progress.final_digest in digests
    lines = [
        f"held-out loss {first:.4f}{f' (step {start})' if start else ''} -> {last:.4f} "
        f"over {cfg.steps} steps in {wall:.1f}s",
        f"bytes per island per sync {per_sync / 1024:.1f} KiB ({cfg.regional_codec}; "
        f"{fp32 / max(per_sync, 1):.1f}x smaller than fp32 {fp32 / 1024:.1f} KiB)",
        f"islands blocked on sync: at most {100 * blocked:.1f}% of their wall time",
        f"final state digest {progress.final_digest} "
        + (
            f"({'the islands that trained to the end' if stopped else 'all islands'} and the "
            "aggregator agree)"
            if agree
            else f"(DISAGREE: {sorted(digests)})"
        ),
        f"state and published inputs: {run_dir}/aggregator, {run_dir}/relay-*; logs: {run_dir}/logs",
    ]
    if stopped:  # an islands:K anneal: the others stopped once their delta of its start was in
        end = cfg.anneal_stop_step
        early = sorted(i for i, e in stopped.items() if e.get("step") != str(end))
        lines.insert(
            4,
            f"anneal {cfg.anneal}: {', '.join(kept or ())} trained the decay; "
            f"{len(stopped)} islands stopped after step {end}, their delta merged in"
            + (f" (NOT at that step: {', '.join(early)})" if early else ""),
        )
        agree = agree and not early
    if cfg.lawa:
        got = progress.lawa
        if got is not None and "digest" in got:
            loss = got.get("heldout_loss")
            lines.insert(
                4,
                f"LAWA average of global rounds {got.get('rounds', '?')}: "
                + (f"held-out loss {float(loss):.4f}, " if loss is not None else "")
                + f"digest {got['digest']} ({run_dir}/aggregator/"
                + ("lawa.pt)" if cfg.fragments == 1 else f"{FRAGMENT_DIR}-*/lawa.pt, joined)"),
            )
        else:
            lines.insert(4, "LAWA average: MISSING (the aggregator logged no event=lawa)")
        agree = agree and got is not None and "digest" in got
    return "\n".join(lines), agree


def cmd_up(args: argparse.Namespace) -> int:
    cfg = run_config_from_args(args)
    keep_rounds = getattr(args, "keep_rounds", 0)
    check_keep_rounds(keep_rounds)  # refused before anything is written
    plan: ChaosPlan | None = None
    if getattr(args, "chaos", None) is not None:  # refused before anything is written
        plan = plan_chaos(cfg, args.chaos, args.island_ranks)
        cfg = plan.cfg
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir = Path(args.run_dir or f"runs/{cfg.run_id}-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.toml").write_text(config_toml(cfg))
    topo = cfg.topology
    print(
        f"hypertrain up: {topo.n_islands} islands in {len(topo.regions)} regions "
        f"({','.join(sorted(topo.regions))}), preset {cfg.model}, {cfg.steps} steps, H_r={topo.h_r} "
        f"H_g={topo.h_g} tau={topo.tau}, {cfg.regional_codec}/{cfg.global_codec}, outer "
        f"{cfg.outer.name}"
        + (f", {cfg.fragments} streaming fragments" if cfg.fragments > 1 else "")
        + f"; run folder {run_dir}",
        flush=True,
    )
    if plan is not None:
        print("\n".join(plan.lines()), flush=True)
    progress = Progress(cfg, quiet=args.quiet)
    children: list[Child] = []
    chaos: ChaosRunner | None = None
    prom: PromHandle | None = None
    t0 = time.monotonic()
    try:
        if args.island_ranks < 1 or cfg.batch_per_island % args.island_ranks:
            raise HypertrainError(
                f"--island-ranks {args.island_ranks} must be >= 1 and divide batch_per_island "
                f"{cfg.batch_per_island}"
            )
        ranks = dict.fromkeys(topo.island_ids(), args.island_ranks)
        hold = () if plan is None else (plan.standby,)
        children = start_cluster(cfg, run_dir, progress, island_ranks=ranks, hold=hold,
                                 island_device=args.island_device,
                                 keep_rounds=keep_rounds)  # fmt: skip
        (run_dir / "processes.txt").write_text(
            "".join(f"{c.name} {c.proc.pid}\n" for c in children)
        )
        targets = write_scrape_targets(children, run_dir / "scrape_targets.json")
        print(
            f"  started {len(children)} processes; aggregator at {children[0].address}; "
            f"metrics of {targets} daemons listed in {run_dir / 'scrape_targets.json'}",
            flush=True,
        )
        if getattr(args, "prometheus", False):
            try:
                prom = start_prometheus(run_dir)
            except RuntimeError as e:  # the run goes on without it
                print(f"hypertrain up: --prometheus: {e}", file=sys.stderr, flush=True)
        if plan is not None:
            relays = relay_addresses(children)
            chaos = ChaosRunner(
                plan,
                children,
                lambda island, label: start_island(
                    run_dir, progress, island, relays[topo.region_of(island)], label=label
                ),
                run_dir / "processes.txt",
            )
            progress.watchers.append(chaos.watch)
            chaos.start()
        failed = supervise(
            children,
            expected=() if chaos is None else chaos.expected,
            busy=None if chaos is None else chaos.busy,
        )
    except KeyboardInterrupt:
        print("hypertrain up: interrupted; stopping every process", file=sys.stderr)
        return 130
    except RuntimeError as e:  # a daemon died before announcing its address
        print(f"hypertrain up: error: {e}", file=sys.stderr)
        return 1
    finally:
        if chaos is not None:
            chaos.stop()
        if prom is not None:
            prom.stop()
            print(f"  prometheus stopped; reopen its data: {prom.restart_command()}", flush=True)
        for child in reversed(children):
            child.stop()
    if failed is not None:
        if chaos is not None:
            print("\n".join(chaos.report_lines()), file=sys.stderr)
        print(f"hypertrain up: error: {failed.failure_message()}", file=sys.stderr)
        print("hypertrain up: stopped every other process", file=sys.stderr)
        return 1
    text, agree = summary(cfg, progress, run_dir, time.monotonic() - t0)
    print(text, flush=True)
    if chaos is not None:
        return chaos_summary(chaos, progress, run_dir, agree)
    return 0 if agree else 1


def chaos_summary(chaos: ChaosRunner, progress: Progress, run_dir: Path, agree: bool) -> int:
    """What ``--chaos`` did, the members of every round, the cutoffs' timing and the audit;
    0 only if every island that was not killed for good finished on the final digest and
    the audit recomputed it."""
    cfg = chaos.cfg
    lines = chaos.report_lines()
    missing = sorted(set(chaos.survivors()) - set(progress.done))
    if missing:
        lines.append(f"islands that did not finish: {', '.join(missing)}")
    trusted = TrustedKeys.load(run_dir / "keys" / "trusted_keys.json")
    try:
        lines += members_lines(run_dir, cfg, trusted)
    except HypertrainError as e:  # the audit below says the same, with its verdict
        lines.append(f"members of every round: cannot read the tapes: {e}")
    lines += cutoff_lines(cfg, chaos.cutoffs)
    verdict, digest = audit_line(run_dir)
    lines.append(verdict)
    ok = agree and not missing and digest is not None and digest == progress.final_digest
    if digest is not None and digest != progress.final_digest:
        lines.append(f"the audit's final digest {digest} is not the run's {progress.final_digest}")
    print("\n".join(lines), flush=True)
    return 0 if ok else 1

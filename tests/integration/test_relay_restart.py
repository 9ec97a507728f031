"""A relay killed with SIGKILL mid-run and restarted with the same flags resumes exactly.

Each trial runs a real 2x2 cluster whose relay of region eu dies once at a pinned
point (``HYPERTRAIN_FAULT=<point>:<n>``), restarts it on the same port and state
folder, and checks that the run still ends bit-identical to the in-process
reference (no input lost, no merge applied twice) and that every tape audits clean.

Points: a regional merge computed but not yet taped; a forward taped but not yet
sent to the aggregator; the checkpoint after a global round not yet renamed into
place (its global update not taped either: recovery resumes from the checkpoint
before and sends the forward again); the checkpoint written but its global update
not yet taped (recovery tapes it, the same bytes it would have written).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hypertrain.common.config import RunConfig
from hypertrain.common.reference import run_reference
from hypertrain.common.shards import relay_member
from hypertrain.common.trust.audit import AuditError, audit_run
from hypertrain.common.trust.certs import init_daemons
from hypertrain.common.trust.keys import TrustedKeys, daemon_key_names
from hypertrain.common.trust.ledger import relay_key
from hypertrain.procs import Child, child_env, python_module
from hypertrain.up import identity_flags
from tests.integration.conftest import Cluster, free_port

CFG = RunConfig.from_dict(
    {
        "steps": 60,  # 3 global rounds
        "batch_per_island": 8,
        "holdout_windows": 16,
        "topology": {"regions": ["eu", "us"], "islands_per_region": 2, "h_r": 10, "h_g": 20},
    }
)


@pytest.fixture(scope="module")
def reference_digest() -> str:
    return run_reference(CFG).final_digest


# point -> how many times relay eu passes it in a run of 3 global rounds
POINTS = {
    "relay_before_merge_entry": 6,
    "relay_after_forward_entry": 3,
    "relay_after_checkpoint": 3,
    "mid_write": 3,
    "before_rename": 3,
}


@pytest.mark.parametrize(
    "fault",
    [
        "relay_before_merge_entry:3",
        "relay_after_forward_entry:1",
        "before_rename:3",
        "relay_after_checkpoint:2",
    ],
)
def test_a_killed_relay_resumes_from_its_tape(
    tmp_path: Path, reference_digest: str, fault: str
) -> None:
    _trial(tmp_path, reference_digest, fault)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault", [f"{p}:{n}" for p in sorted(POINTS) for n in range(1, POINTS[p] + 1)]
)
def test_a_killed_relay_resumes_from_its_tape_at_every_point(
    tmp_path: Path, reference_digest: str, fault: str
) -> None:
    _trial(tmp_path, reference_digest, fault)


@pytest.mark.parametrize("fault", ["relay_after_forward_entry:1", "before_rename:2"])
def test_a_killed_relay_shard_resumes_from_its_tape(
    tmp_path: Path, reference_digest: str, fault: str
) -> None:
    """The same with each region's relay as 2 shard processes: shard 1 of eu dies and
    resumes from its own checkpoint and tape (its range only); the run ends on the digest
    of one relay per region and every shard's tape audits clean."""
    _trial(tmp_path, reference_digest, fault, CFG.with_overrides(**{"topology.relay_shards": 2}))


def test_a_relay_killed_at_the_anneal_switch_resumes_from_its_tape(tmp_path: Path) -> None:
    """Killed after its forward of the anneal's first step (40), before the switch's tape
    entry: the restarted relay tapes the switch and syncs every step after it."""
    cfg = CFG.with_overrides(anneal="h_r1")
    _trial(tmp_path, run_reference(cfg).final_digest, "before_anneal_entry:1", cfg)


def test_a_relay_killed_while_it_prunes_resumes_from_what_it_kept(tmp_path: Path) -> None:
    """Every relay and the aggregator keep 2 global rounds (``keep_rounds`` in their config
    tables, the ``--keep-rounds`` flag's setting); relay eu dies between deleting the
    checkpoint of round 0 and the inputs only it needed, restarts from what it kept and
    prunes again at the next round.  The run ends on the reference digest, every node
    keeps its 2 newest rounds, and the run audits from the oldest kept (a whole-run audit
    names that round)."""
    cfg = CFG.with_overrides(steps=80)  # 4 global rounds: pruned after rounds 2 and 3
    _trial(tmp_path, run_reference(cfg).final_digest, "prune_mid:1", cfg, keep_rounds=2)


def _trial(
    tmp_path: Path,
    reference_digest: str,
    fault: str,
    cfg: RunConfig = CFG,
    keep_rounds: int = 0,
) -> None:
    """One run whose relay eu (with relay shards: its last shard) dies at ``fault`` and
    is restarted; ``keep_rounds``: the relays' and the aggregator's (0: all).

    At the checkpoint of the last round the relay has fetched the final state but
    not yet reported it durable: the aggregator must still be there to serve it
    again (it ends when every relay has reported, not fetched)."""
    cluster = Cluster(cfg, tmp_path / "run")
    run_dir = cluster.run_dir
    if keep_rounds:
        with (run_dir / "run.toml").open("a") as f:
            f.write(f"\n[relay]\nkeep_rounds = {keep_rounds}\n")
            f.write(f"\n[aggregator]\nkeep_rounds = {keep_rounds}\n")
    keys = run_dir / "keys"
    init_daemons(keys, daemon_key_names(cfg.topology))
    port = free_port()
    count = cfg.topology.relay_shards

    def start(name: str, module: str, *args: str, env: dict[str, str] | None = None) -> Child:
        who = identity_flags(keys, name.removesuffix("-again"))
        argv = python_module(module, "--config", str(run_dir / "run.toml"), *who, *args)
        child = Child(
            name,
            argv,
            run_dir / "logs" / f"{name}.log",
            cluster.progress.on_event,
            child_env() | (env or {}),
        )
        cluster.children.append(child)
        return child

    try:
        agg = start(
            "aggregator", "hypertrain.aggregator", "--state-dir", str(run_dir / "aggregator")
        )
        agg_address = agg.wait_listening()
        names = {  # relay process name -> (region, shard)
            relay_key(relay_member(region, i, count)): (region, i)
            for region in sorted(cfg.topology.regions)
            for i in range(count)
        }
        victim_name = relay_key("eu" if count == 1 else f"eu/{count - 1}")
        relay_args = {
            name: (
                *("--region", region, "--aggregator", agg_address),
                *(("--shard", f"{i}/{count}") if count > 1 else ()),
                *("--state-dir", str(run_dir / name)),
                *("--listen", f"127.0.0.1:{port}" if name == victim_name else "127.0.0.1:0"),
            )
            for name, (region, i) in names.items()
        }
        victim = start(
            victim_name,
            "hypertrain.relay",
            *relay_args[victim_name],
            env={"HYPERTRAIN_FAULT": fault},
        )
        addresses = {victim_name: victim.wait_listening()}
        for name in names:
            if name != victim_name:
                addresses[name] = start(
                    name, "hypertrain.relay", *relay_args[name]
                ).wait_listening()
        for island in cfg.topology.island_ids():
            region, _, index = island.rpartition("-")
            relay = ",".join(addresses[n] for n, (r, _) in names.items() if r == region)
            start(
                f"island-{island}",
                "hypertrain.island",
                *("--region", region, "--index", index, "--relay", relay),
                *("--state-dir", str(run_dir / f"island-{island}")),
            )
        again: Child | None = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if again is None and victim.proc.poll() == -9:
                again = start(f"{victim_name}-again", "hypertrain.relay", *relay_args[victim_name])
            others = [c for c in cluster.children if c is not victim]
            failed = [c for c in others if c.proc.poll() not in (None, 0)]
            assert not failed, failed[0].failure_message()
            if all(c.proc.poll() == 0 for c in others) and again is not None:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"fault {fault}: the run did not finish")
        assert again is not None, f"fault {fault} never fired"
        log = again.log_path.read_text()
        assert "event=recovered role=relay region=eu" in log, log
        # What the kill left mid-write (a checkpoint's temp file) went when it restarted.
        for sub in ("checkpoints", "published"):
            left = [p.name for p in (run_dir / victim_name / sub).glob(".*")]
            assert not left, (fault, sub, left)
        if fault.startswith(("before_rename", "mid_write")):
            assert "event=swept role=relay region=eu" in log, log
    finally:
        cluster.stop()
    digests = {e["digest"] for e in cluster.progress.done.values()}
    assert digests == {reference_digest}, f"{fault}: islands {digests} != reference"
    trusted = TrustedKeys.load(keys / "trusted_keys.json")
    last = cfg.steps // cfg.topology.h_g - 1
    start = None
    if keep_rounds:
        start = last - keep_rounds + 1
        for node in ("aggregator", "relay-eu", "relay-us"):
            kept = sorted(p.name for p in (run_dir / node / "checkpoints").glob("round-*.pt"))
            assert kept == [f"round-{r:06d}.pt" for r in range(start, last + 1)], (node, kept)
            log = "".join(p.read_text() for p in (run_dir / "logs").glob(f"{node}*.log"))
            assert f"event=pruned role={node.split('-')[0]}" in log, log
        with pytest.raises(AuditError, match=f"--from-round {start}"):
            audit_run(run_dir, trusted)
    report = audit_run(run_dir, trusted, from_round=start)
    assert report.final_digest == reference_digest and report.last_round == last


def test_a_relay_without_a_tape_refuses_to_resume_an_earlier_state(tmp_path: Path) -> None:
    """Without --signing-key a relay keeps no tape, so it cannot redo a round: started
    on a state folder of an earlier start it exits 2 with one line saying why, instead
    of serving islands from a fresh state that no longer matches theirs."""
    import subprocess
    import sys

    cluster = Cluster(CFG, tmp_path / "run")
    state = tmp_path / "relay-eu"
    (state / "published").mkdir(parents=True)
    (state / "published" / ("ab" * 32)).write_bytes(b"an input of an earlier start")
    try:
        agg = cluster.spawn(
            "aggregator", "hypertrain.aggregator", "--state-dir", str(tmp_path / "aggregator")
        )
        argv = [
            sys.executable,
            "-m",
            "hypertrain.relay",
            "--config",
            str(cluster.run_dir / "run.toml"),
            "--insecure",
        ]
        argv += ["--region", "eu", "--aggregator", agg.wait_listening(), "--state-dir", str(state)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=child_env())
    finally:
        cluster.stop()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot resume" in done.stderr and str(state) in done.stderr, done.stderr


def test_daemons_restarted_after_the_run_see_it_is_over_and_exit(tmp_path: Path) -> None:
    """Who has the final state is kept on disk (``<state>/final/<member>``): the
    aggregator and a relay started again after a finished run (the aggregator gone,
    for the relay) recover, see that every member has the final state, and exit 0
    without waiting for anyone."""
    cluster = Cluster(CFG, tmp_path / "run")
    try:
        failed = cluster.run_all(timeout_s=300)
        assert failed is None, failed.failure_message()
        argv = {c.name: c.argv for c in cluster.children}
        for name in ("aggregator", "relay-eu"):
            again = Child(
                f"{name}-again",
                argv[name],
                cluster.run_dir / "logs" / f"{name}-again.log",
                None,
                child_env(),
            )
            cluster.children.append(again)
            assert again.proc.wait(timeout=120) == 0, again.failure_message()
            log = again.log_path.read_text()
            assert "event=recovered" in log and "run complete" in log, log
    finally:
        cluster.stop()

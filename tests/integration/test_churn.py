"""Islands that die, stall, leave or join, with the real daemons: a sync step goes ahead
without them at its cutoff, a late delta is refused as stale and its island takes the
merge instead, below the quorum nothing commits, a SIGTERMed island announces its leave
and a restarted one joins again; the tapes name every absence and change and audit
clean."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from hypertrain.common.config import RunConfig
from hypertrain.common.trust.audit import audit_run
from hypertrain.common.trust.keys import TrustedKeys
from hypertrain.common.trust.schema import MemberEntry, RegionalMergeEntry, RejectionEntry
from hypertrain.common.trust.tape import verify_tape
from hypertrain.procs import Child, child_env, parse_logfmt
from hypertrain.up import start_cluster, supervise
from tests.conftest import proc_state

CUTOFF_S = 3.0
CFG = RunConfig.from_dict(
    {
        "steps": 30,
        "holdout_windows": 16,
        "regional_codec": "int8",
        "topology": {"regions": ["eu", "us"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
        "membership": {"regional_cutoff_s": CUTOFF_S, "global_cutoff_s": 30.0},
    }
)


def _events(log: Path, event: str) -> list[dict[str, str]]:
    """The log lines of ``event`` (logfmt: every value a string)."""
    if not log.exists():
        return []
    lines = (parse_logfmt(line) for line in log.read_text().splitlines())
    return [e for e in lines if e.get("event") == event]


def _wait_for(what: str, check, timeout_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise TimeoutError(f"no {what} after {timeout_s:.0f}s")
        time.sleep(0.05)


#: eu-1 stops itself just before its third push (that of step 15): an exact point,
#: whatever the machine's speed (``daemon.fault_point``).
STOP_BEFORE_15 = {"island-eu-1": {"HYPERTRAIN_FAULT": "island_before_push:3:stop"}}


def _stall(island: object, until: str, check, timeout_s: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    """Wait for ``island`` (started with ``STOP_BEFORE_15``) to stop itself before its
    push of step 15; SIGCONT it once ``check()`` holds (``until`` says what that is)."""
    name = island.name  # type: ignore[attr-defined]
    pid = island.proc.pid  # type: ignore[attr-defined]

    def stopped() -> bool:
        assert island.proc.poll() is None, island.failure_message()  # type: ignore[attr-defined]
        return proc_state(pid) == "T"

    _wait_for(f"{name} stopped before its push of step 15", stopped)
    try:
        _wait_for(until, check, timeout_s)
    finally:
        os.kill(pid, signal.SIGCONT)


def _relay_entries(run_dir: Path, region: str) -> list:
    trusted = TrustedKeys.load(run_dir / "keys" / "trusted_keys.json")
    return verify_tape(run_dir / f"relay-{region}" / "tape", trusted).entries


def _audit(run_dir: Path) -> str:
    trusted = TrustedKeys.load(run_dir / "keys" / "trusted_keys.json")
    return audit_run(run_dir, trusted).final_digest


def test_an_island_killed_for_good_and_its_region_goes_on(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_factory(CFG)
    run_dir = cluster.run_dir
    children = start_cluster(
        CFG,
        run_dir,
        cluster.progress,
        env_of={"island-eu-1": {"HYPERTRAIN_FAULT": "island_before_push:2"}},
    )
    cluster.children.extend(children)
    dead = next(c for c in children if c.name == "island-eu-1")
    others = [c for c in children if c is not dead]
    failed = supervise(others, deadline_s=300)
    assert failed is None, failed.failure_message()
    assert dead.proc.wait(timeout=10) == -signal.SIGKILL
    progress = cluster.progress
    assert sorted(progress.done) == ["eu-0", "us-0", "us-1"]
    digests = {e["digest"] for e in progress.done.values()}
    assert digests == {progress.final_digest}, digests
    entries = _relay_entries(run_dir, "eu")
    merges = [RegionalMergeEntry.from_body(e.body) for e in entries if e.kind == "regional_merge"]
    assert [(m.sync_step, m.absent) for m in merges] == [(5, None)] + [
        (s, ("eu-1",)) for s in range(10, 31, 5)
    ]
    assert sum(e.kind == "cutoff" for e in entries) == 5
    # Each step without eu-1 committed about CUTOFF_S after its first delivery.
    cutoffs = _events(run_dir / "logs" / "relay-eu.log", "cutoff")
    assert [int(c["step"]) for c in cutoffs] == list(range(10, 31, 5))
    assert all(c["absent"] == "eu-1" and c["waiting"] == "False" for c in cutoffs)
    # Each came its cutoff after the step's first delivery (the timer's own lateness is
    # reported, not asserted: timing is not a unit test's business).
    waits = [float(c["since_first_s"]) for c in cutoffs]
    assert all(w >= CUTOFF_S for w in waits), waits
    print(f"cutoffs came {min(waits):.3f}-{max(waits):.3f} s after their first delivery")
    assert _audit(run_dir) == progress.final_digest


def test_a_stalled_island_is_refused_as_stale_and_takes_the_merge(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_factory(CFG)
    run_dir = cluster.run_dir
    cluster.children.extend(start_cluster(CFG, run_dir, cluster.progress, env_of=STOP_BEFORE_15))
    island = next(c for c in cluster.children if c.name == "island-eu-1")
    logs = run_dir / "logs"
    # Stopped before its push of step 15, so that it misses that step.
    _stall(
        island,
        "commit of step 15 without eu-1",
        lambda: any(
            e["step"] == "15" and e.get("absent") == "eu-1"
            for e in _events(logs / "relay-eu.log", "round")
        ),
    )
    failed = supervise(cluster.children, deadline_s=300)
    assert failed is None, failed.failure_message()
    progress = cluster.progress
    assert sorted(progress.done) == ["eu-0", "eu-1", "us-0", "us-1"]
    digests = {e["digest"] for e in progress.done.values()}
    assert digests == {progress.final_digest}, digests
    assert int(progress.done["eu-1"]["stale"]) >= 1
    stale = _events(logs / "island-eu-1.log", "stale")
    assert stale[0]["step"] == "15"
    assert "sync step 15 of region eu closed without eu-1 at its cutoff" in stale[0]["message"]
    entries = _relay_entries(run_dir, "eu")
    evidence = [
        RejectionEntry.from_body(e.body)
        for e in entries
        if e.kind == "rejection" and e.body.get("sync_step") == 15
    ]
    assert evidence and evidence[0].sender == "eu-1" and evidence[0].digest
    assert evidence[0].code == "failed_precondition"
    assert _audit(run_dir) == progress.final_digest


def test_an_island_stalled_past_a_global_round_rejoins_from_a_later_one(
    cluster_factory,
) -> None:  # type: ignore[no-untyped-def]
    """Stopped before its push of step 15 until its region committed step 30: the global
    merge of step 20 it asks for is gone, so the relay answers with that of step 30, and
    the island heals there and trains the last round with the others."""
    cfg = CFG.with_overrides(steps=40)
    cluster = cluster_factory(cfg)
    run_dir = cluster.run_dir
    cluster.children.extend(start_cluster(cfg, run_dir, cluster.progress, env_of=STOP_BEFORE_15))
    island = next(c for c in cluster.children if c.name == "island-eu-1")
    logs = run_dir / "logs"
    _stall(
        island,
        "global round of step 30 at relay eu",
        lambda: any(e["step"] == "30" for e in _events(logs / "relay-eu.log", "global")),
        timeout_s=240,
    )
    failed = supervise(cluster.children, deadline_s=300)
    assert failed is None, failed.failure_message()
    progress = cluster.progress
    assert sorted(progress.done) == ["eu-0", "eu-1", "us-0", "us-1"]
    assert {e["digest"] for e in progress.done.values()} == {progress.final_digest}
    healed = _events(logs / "island-eu-1.log", "healed")
    assert [(e["wanted"], e["step"]) for e in healed] == [("20", "30")]
    assert progress.done["eu-1"]["heals"] == "1"
    entries = _relay_entries(run_dir, "eu")
    last = RegionalMergeEntry.from_body(
        next(e for e in reversed(entries) if e.kind == "regional_merge").body
    )
    assert last.sync_step == 40 and last.absent is None  # a member again at the end
    assert _audit(run_dir) == progress.final_digest


def test_an_island_that_leaves_on_sigterm_is_not_waited_for_and_joins_again(
    cluster_factory,
) -> None:  # type: ignore[no-untyped-def]
    """No cutoffs at all: only eu-1's announced leave lets region eu go on without it.
    Restarted, it joins again (a member entry), starts from the global merge its relay
    names, and ends on the same digest as everyone."""
    cfg = CFG.with_overrides(steps=40, membership={})
    cluster = cluster_factory(cfg)
    run_dir = cluster.run_dir
    cluster.children.extend(start_cluster(cfg, run_dir, cluster.progress))
    logs = run_dir / "logs"
    eu0, eu1 = (next(c for c in cluster.children if c.name == f"island-eu-{k}") for k in (0, 1))
    _wait_for(
        "global merge of step 10 at eu-1",
        lambda: any(e["step"] == "10" for e in _events(logs / "island-eu-1.log", "sync")),
    )
    # Keep region eu where it is while eu-1 leaves and starts again, so that it joins
    # mid-run (alone, eu-0 would finish the run first).
    os.kill(eu0.proc.pid, signal.SIGSTOP)
    try:
        eu1.proc.send_signal(signal.SIGTERM)
        assert eu1.proc.wait(timeout=60) == 0  # left: a clean end
        (leave,) = _events(logs / "island-eu-1.log", "leave")
        assert leave["announced"] == "True", leave
        # As if the island's clock had been far ahead when it left: its next request must
        # still be issued after that one (the relay refuses older ones).
        mark = run_dir / "island-eu-1" / "member-issued"
        ahead = int(mark.read_text()) + 10**15
        mark.write_text(str(ahead))
        again = Child(
            eu1.name,
            eu1.argv,
            logs / "island-eu-1.rejoin.log",
            cluster.progress.on_event,
            child_env(),
        )
        cluster.children.append(again)
        _wait_for("the join of eu-1", lambda: _events(logs / "relay-eu.log", "join"))
    finally:
        os.kill(eu0.proc.pid, signal.SIGCONT)
    failed = supervise([c for c in cluster.children if c is not eu1], deadline_s=300)
    assert failed is None, failed.failure_message()
    progress = cluster.progress
    assert sorted(progress.done) == ["eu-0", "eu-1", "us-0", "us-1"]
    assert {e["digest"] for e in progress.done.values()} == {progress.final_digest}
    entries = _relay_entries(run_dir, "eu")
    changes = [MemberEntry.from_body(e.body) for e in entries if e.kind == "member"]
    assert [(c.change, c.member) for c in changes] == [("leave", "eu-1"), ("join", "eu-1")]
    left, joined = changes[0].sync_step, changes[1].sync_step
    assert joined > left and changes[1].start == joined - 5
    assert changes[1].issued == ahead + 1
    merges = [RegionalMergeEntry.from_body(e.body) for e in entries if e.kind == "regional_merge"]
    for m in merges:  # nobody absent: the members of each step are those it had
        members = [name for name, _ in m.members]
        assert m.absent is None
        assert members == (["eu-0"] if left <= m.sync_step < joined else ["eu-0", "eu-1"])
    assert (run_dir / "logs" / "island-eu-1.rejoin.log").read_text().count("event=joined") == 1
    assert _audit(run_dir) == progress.final_digest


def test_below_the_quorum_nothing_commits_until_it_is_back(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    """A quorum of both islands: eu-1 stopped past the cutoff of step 15 leaves region eu
    below it; the cutoff is taped and logged as waiting, nothing commits; resumed, eu-1
    delivers and the step commits with both."""
    cfg = CFG.with_overrides(**{"membership.regional_quorum": 2})
    cluster = cluster_factory(cfg)
    run_dir = cluster.run_dir
    cluster.children.extend(start_cluster(cfg, run_dir, cluster.progress, env_of=STOP_BEFORE_15))
    island = next(c for c in cluster.children if c.name == "island-eu-1")
    logs = run_dir / "logs"
    relay_log = logs / "relay-eu.log"

    def waited() -> bool:
        cut = [e for e in _events(relay_log, "cutoff") if e["step"] == "15"]
        if not cut:
            return False
        assert cut[0]["waiting"] == "True" and cut[0]["absent"] == "eu-1", cut
        time.sleep(CUTOFF_S)  # ... and still nothing commits
        return True

    _stall(island, "cutoff of step 15 below the quorum", waited)
    assert not [e for e in _events(relay_log, "round") if e["step"] == "15"]
    failed = supervise(cluster.children, deadline_s=300)
    assert failed is None, failed.failure_message()
    progress = cluster.progress
    assert {e["digest"] for e in progress.done.values()} == {progress.final_digest}
    assert len(progress.done) == 4
    entries = _relay_entries(run_dir, "eu")
    merges = [RegionalMergeEntry.from_body(e.body) for e in entries if e.kind == "regional_merge"]
    step15 = next(m for m in merges if m.sync_step == 15)
    assert [n for n, _ in step15.members] == ["eu-0", "eu-1"] and step15.absent is None
    assert _audit(run_dir) == progress.final_digest


def test_a_region_everyone_left_follows_the_run_to_its_end(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    """Both islands of region eu leave (SIGTERM) after step 10: with a global cutoff the
    rounds go on with us alone, eu's relay takes each global merge without a forward, and
    every daemon, eu's relay included, ends with the run; the audit replays it all."""
    cfg = CFG.with_overrides(**{"membership.global_cutoff_s": 3.0})
    cluster = cluster_factory(cfg)
    run_dir = cluster.run_dir
    cluster.children.extend(start_cluster(cfg, run_dir, cluster.progress))
    logs = run_dir / "logs"
    eu = [c for c in cluster.children if c.name.startswith("island-eu-")]
    _wait_for(
        "global merge of step 10 in region eu",
        lambda: all(
            any(e["step"] == "10" for e in _events(logs / f"{c.name}.log", "sync")) for c in eu
        ),
    )
    for c in eu:
        c.proc.send_signal(signal.SIGTERM)
    for c in eu:
        assert c.proc.wait(timeout=60) == 0
    failed = supervise(cluster.children, deadline_s=300)
    assert failed is None, failed.failure_message()
    _ended_with_us_alone(cluster, logs / "relay-eu.log")


def _ended_with_us_alone(cluster, relay_log: Path) -> None:  # type: ignore[no-untyped-def]
    """Region us's islands ended on the run's final digest; eu's relay (its log
    ``relay_log``) followed the global rounds to the last step; the audit replays it."""
    progress = cluster.progress
    assert sorted(progress.done) == ["us-0", "us-1"]
    assert {e["digest"] for e in progress.done.values()} == {progress.final_digest}
    followed = [e for e in _events(relay_log, "global") if e.get("followed")]
    assert followed and followed[-1]["step"] == str(cluster.cfg.steps), followed
    assert _audit(cluster.run_dir) == progress.final_digest


def test_a_following_relay_whose_store_fails_stops_then_recovers(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    """As above, region eu empty after step 10; then eu's relay cannot write its next
    checkpoint (its ``checkpoints`` folder replaced by a plain file).  Following the round
    of step 20 it ends at once (exit code 1, one line naming what could not be made
    durable), as on the forwarding path, with nothing of that round taped; started again
    on a working disk it recovers from its tape, follows the run to its end, and the
    audit replays it all."""
    cfg = CFG.with_overrides(**{"membership.global_cutoff_s": 3.0})
    cluster = cluster_factory(cfg)
    run_dir = cluster.run_dir
    cluster.children.extend(start_cluster(cfg, run_dir, cluster.progress))
    logs = run_dir / "logs"
    relay = next(c for c in cluster.children if c.name == "relay-eu")
    eu = [c for c in cluster.children if c.name.startswith("island-eu-")]
    us = [c for c in cluster.children if c.name.startswith("island-us-")]
    _wait_for(
        "global merge of step 10 in both regions",
        lambda: all(
            any(e["step"] == "10" for e in _events(logs / f"{c.name}.log", "sync")) for c in eu + us
        ),
    )
    for c in us:  # held until the folder is broken: no round 20 before it, however slow
        c.proc.send_signal(signal.SIGSTOP)
    try:
        for c in eu:
            c.proc.send_signal(signal.SIGTERM)
        for c in eu:
            assert c.proc.wait(timeout=60) == 0
        # Its checkpoint of step 10 is down (logged after it is written): break the
        # folder for the next one, a followed round's.
        _wait_for(
            "relay-eu's global of step 10",
            lambda: any(e["step"] == "10" for e in _events(logs / "relay-eu.log", "global")),
        )
        folder = run_dir / "relay-eu" / "checkpoints"
        folder.rename(folder.with_name("checkpoints.kept"))
        folder.write_bytes(b"not a folder")
    finally:
        for c in us:
            c.proc.send_signal(signal.SIGCONT)
    tape = run_dir / "relay-eu" / "tape"
    assert relay.proc.wait(timeout=120) == 1, relay.failure_message()
    stopped = _events(logs / "relay-eu.log", "stopped")
    assert len(stopped) == 1 and stopped[0]["failed"] == "True", stopped
    reason = stopped[0]["reason"]
    assert reason.startswith("followed global step 20 could not be made durable"), reason
    assert not any(e.get("followed") for e in _events(logs / "relay-eu.log", "global"))
    entries = _relay_entries(run_dir, "eu")
    assert not any(e.kind == "global_applied" and e.body["sync_step"] == 20 for e in entries)
    size = tape.stat().st_size
    folder.unlink()
    folder.with_name("checkpoints.kept").rename(folder)
    cluster.again(relay, "relay-eu-again")
    failed = supervise(
        [c for c in cluster.children if c is not relay and c not in eu], deadline_s=300
    )
    assert failed is None, failed.failure_message()
    assert tape.stat().st_size > size
    _ended_with_us_alone(cluster, logs / "relay-eu-again.log")

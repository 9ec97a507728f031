"""The end of a run with islands killed around its final merge, with the real daemons.

A relay's work ends when every island of the last step has reported that it keeps the
final state (``RelayNode.applied``), not when the last byte of the merge went out: an
island killed after it got the merge, before it reported, is started again and must
still find its relay.  One island here dies before it marks its final state (started
again, it retrains from its rejoin state and fetches the merge once more), the other
after it marked it, before its report (started again, it only reports).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from hypertrain.common.config import RunConfig
from hypertrain.common.trust.audit import audit_run
from hypertrain.common.trust.keys import TrustedKeys
from hypertrain.procs import Child, child_env, parse_logfmt
from hypertrain.up import start_cluster, supervise

CFG = RunConfig.from_dict(
    {
        "steps": 20,
        "holdout_windows": 16,
        "topology": {"regions": ["eu"], "islands_per_region": 2, "h_r": 5, "h_g": 10},
    }
)


def _events(log: Path, event: str) -> list[dict[str, str]]:
    if not log.exists():
        return []
    lines = (parse_logfmt(line) for line in log.read_text().splitlines())
    return [e for e in lines if e.get("event") == event]


def test_islands_killed_around_the_final_merge_are_waited_for(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_factory(CFG)
    run_dir = cluster.run_dir
    logs = run_dir / "logs"
    faults = {
        "island-eu-0": {"HYPERTRAIN_FAULT": "island_before_final_mark:1"},
        "island-eu-1": {"HYPERTRAIN_FAULT": "island_before_final_report:1"},
    }
    children = start_cluster(CFG, run_dir, cluster.progress, env_of=faults)
    cluster.children.extend(children)
    islands = [c for c in children if c.name.startswith("island-")]
    relay = next(c for c in children if c.name == "relay-eu")
    for island in islands:
        assert island.proc.wait(timeout=300) == -signal.SIGKILL, island.failure_message()
    assert not (run_dir / "island-eu-0" / "final").exists()
    mark = json.loads((run_dir / "island-eu-1" / "final").read_text())
    # Both got the final merge; neither reported it: the relay waits for them.
    time.sleep(2.0)
    assert relay.proc.poll() is None, relay.failure_message()
    assert not _events(logs / "relay-eu.log", "stopped")
    again = [
        Child(c.name, c.argv, logs / f"{c.name}.again.log", cluster.progress.on_event, child_env())
        for c in islands
    ]
    cluster.children.extend(again)
    rest = [c for c in cluster.children if c not in islands]
    failed = supervise(rest, deadline_s=300)
    assert failed is None, failed.failure_message()
    progress = cluster.progress
    assert sorted(progress.done) == ["eu-0", "eu-1"]
    assert {e["digest"] for e in progress.done.values()} == {progress.final_digest}
    assert mark["digest"] == progress.final_digest
    # eu-0 trained its last steps again and fetched the final merge once more; eu-1 only
    # reported the state it had marked.
    (done0,) = _events(logs / "island-eu-0.again.log", "done")
    (done1,) = _events(logs / "island-eu-1.again.log", "done")
    assert "resumed" not in done0 and done1["resumed"] == "True"
    assert _events(logs / "island-eu-0.again.log", "resumed")
    assert not _events(logs / "island-eu-1.again.log", "sync")
    (stopped,) = _events(logs / "relay-eu.log", "stopped")
    assert "every island has the final merge" in stopped["reason"]
    assert sorted(p.name for p in (run_dir / "relay-eu" / "final").iterdir()) == ["eu-0", "eu-1"]
    trusted = TrustedKeys.load(run_dir / "keys" / "trusted_keys.json")
    assert audit_run(run_dir, trusted).final_digest == progress.final_digest
    # A mark written before digest format 2 (no "digest_format": a sha256 state digest)
    # is refused by name, not reported as if this island's state disagreed with the run's.
    old = json.loads((run_dir / "island-eu-1" / "final").read_text())
    del old["digest_format"]
    (run_dir / "island-eu-1" / "final").write_text(json.dumps(old))
    island = islands[1]
    third = Child(island.name, island.argv, logs / f"{island.name}.third.log", env=child_env())
    cluster.children.append(third)
    assert third.proc.wait(timeout=120) != 0
    third.drain()
    text = (logs / f"{island.name}.third.log").read_text()
    assert "holds a state digest of digest format 1; this build computes format 2" in text, text

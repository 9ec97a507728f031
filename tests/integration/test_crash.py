"""The aggregator killed with SIGKILL at points in its tape and checkpoint writes.

Each trial runs a real 2x2 cluster whose aggregator dies once at a pinned
point (``HYPERTRAIN_FAULT=<point>:<n>``: the n-th time it passes that point,
it SIGKILLs itself), restarts it on the same port, and checks that the run
still ends bit-identical to the in-process reference (no round lost, none
applied twice) with tapes that audit clean.  A few trials run by default,
50 in the slow suite (`bash scripts/test.sh -m slow`).
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from hypertrain.common.config import RunConfig
from hypertrain.common.reference import run_reference
from hypertrain.common.trust.audit import audit_run
from hypertrain.common.trust.certs import init_daemons
from hypertrain.common.trust.keys import TrustedKeys, daemon_key_names
from hypertrain.procs import Child, child_env
from hypertrain.up import identity_flags
from tests.integration.conftest import Cluster, free_port

CFG = RunConfig.from_dict(
    {
        "steps": 100,  # 5 global rounds
        "batch_per_island": 8,
        "holdout_windows": 16,
        "topology": {"regions": ["eu", "us"], "islands_per_region": 2, "h_r": 10, "h_g": 20},
    }
)
# point -> how many times the aggregator passes it in a run of 5 rounds (one checkpoint
# file a round: state.pt is a hard link to it, written without either write point)
POINTS = {
    "before_tape": 5,
    "after_tape": 5,
    "mid_write": 5,
    "before_rename": 5,
    "between_checkpoints": 5,
}


@pytest.fixture(scope="module")
def reference_digest() -> str:
    return run_reference(CFG).final_digest


def _trial(
    tmp: Path, point: str, n: int, reference: str, cfg: RunConfig = CFG, stop: bool = False
) -> Cluster:
    """``stop``: the fault SIGSTOPs the aggregator, which is SIGKILLed a second later
    (what was sent before the point has arrived by then)."""
    cluster = Cluster(cfg, tmp / "run")
    run_dir = cluster.run_dir
    keys = run_dir / "keys"
    init_daemons(keys, daemon_key_names(cfg.topology))
    port = free_port()
    args = (
        "--listen",
        f"127.0.0.1:{port}",
        "--state-dir",
        str(run_dir / "aggregator"),
        *identity_flags(keys, "aggregator"),
    )

    def start_aggregator(fault: str | None, k: int) -> Child:
        env = child_env() | ({"HYPERTRAIN_FAULT": fault} if fault else {})
        from hypertrain.procs import python_module

        argv = python_module("hypertrain.aggregator", "--config", str(run_dir / "run.toml"), *args)
        child = Child(
            f"aggregator-{k}",
            argv,
            run_dir / "logs" / f"aggregator-{k}.log",
            cluster.progress.on_event,
            env,
        )
        cluster.children.append(child)
        child.wait_listening()
        return child

    try:
        agg = start_aggregator(f"{point}:{n}" + (":stop" if stop else ""), 0)
        relays = {}
        for region in cfg.topology.regions:
            relays[region] = cluster.spawn(
                f"relay-{region}",
                "hypertrain.relay",
                "--region",
                region,
                "--aggregator",
                f"127.0.0.1:{port}",
                "--state-dir",
                str(run_dir / f"relay-{region}"),
                *identity_flags(keys, f"relay-{region}"),
            )
        for island in cfg.topology.island_ids():
            region, _, index = island.rpartition("-")
            cluster.spawn(
                f"island-{island}",
                "hypertrain.island",
                "--region",
                region,
                "--index",
                index,
                "--relay",
                relays[region].wait_listening(),
                *identity_flags(keys, f"island-{island}"),
                "--state-dir",
                str(run_dir / f"island-{island}"),
            )
        restarts = 0
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if stop and restarts == 0 and _stopped(agg.proc.pid):
                time.sleep(2.0)  # the fetches waiting at the relays take the header
                os.kill(agg.proc.pid, signal.SIGKILL)
                agg.proc.wait()
            if agg.proc.poll() == -9 and restarts == 0:
                restarts += 1
                agg = start_aggregator(None, restarts)
            failed = [
                c
                for c in cluster.children
                if c.proc.poll() not in (None, 0)
                and c is not agg
                and not c.name.startswith("aggregator-0")
            ]
            assert not failed, failed[0].failure_message()
            if all(
                c.proc.poll() == 0
                for c in cluster.children
                if not c.name.startswith("aggregator-0")
            ):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"trial {point}:{n} did not finish")
        assert restarts == 1, f"fault {point}:{n} never fired"
    finally:
        cluster.stop()
    digests = {e["digest"] for e in cluster.progress.done.values()}
    assert digests == {reference}, f"{point}:{n}: islands {digests} != reference {reference}"
    report = audit_run(run_dir, TrustedKeys.load(run_dir / "keys" / "trusted_keys.json"))
    assert report.final_digest == reference
    assert report.last_round == cfg.steps // cfg.topology.h_g - 1
    # What the kill left mid-write (a checkpoint's temp file) went when it resumed.
    folder = run_dir / "aggregator"
    left = [*(folder / "checkpoints").glob(".*"), *folder.glob(".state.pt.*")]
    assert not left, (point, n, [p.name for p in left])
    return cluster


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] == "T"


def _trials(count: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    names = sorted(POINTS)
    return [(p, rng.randint(1, POINTS[p] - 1)) for p in (rng.choice(names) for _ in range(count))]


@pytest.mark.parametrize("point,n", [("after_tape", 2), ("before_tape", 3), ("mid_write", 5)])
def test_aggregator_crash_recovers_exactly(
    tmp_path: Path, reference_digest: str, point: str, n: int
) -> None:
    _trial(tmp_path, point, n, reference_digest)


def test_aggregator_killed_at_the_anneal_switch_resumes_on_the_same_digest(
    tmp_path: Path,
) -> None:
    """Killed after the checkpoint of the anneal's first round (step 80), before the
    switch's tape entry: the restarted aggregator tapes the switch, the run ends on the
    in-process digest, the tapes audit clean."""
    cfg = CFG.with_overrides(anneal="h_r1")
    _trial(tmp_path, "before_anneal_entry", 1, run_reference(cfg).final_digest, cfg)


def test_aggregator_killed_mid_merge_cuts_the_relays_cut_through_short(
    tmp_path: Path, reference_digest: str
) -> None:
    """The aggregator stops right after the header of round 1's global merge went to the
    first relay that fetched it, which begins serving the merge to its islands while it
    arrives (services/wire/cutthrough.py); then the aggregator is killed and restarted.
    The relay's download fails, the islands' downloads from it end UNAVAILABLE (its log
    says ``cut_short``) before their last byte, everyone asks again, and the run ends on
    the in-process digest with tapes that audit clean."""
    cluster = _trial(tmp_path, "merge_header_served", 3, reference_digest, stop=True)
    logs = cluster.run_dir / "logs"
    cut = [
        line
        for region in CFG.topology.regions
        for line in (logs / f"relay-{region}.log").read_text().splitlines()
        if "event=cut_short" in line
    ]
    assert cut, "no island's download was cut short"
    assert all("step=40" in line for line in cut), cut
    lines = [
        line
        for region in CFG.topology.regions
        for line in (logs / f"relay-{region}.log").read_text().splitlines()
    ]
    # Islands got merges while they arrived, under the header the relay then applied them
    # with (its receipts included: the run's keys are pinned).
    assert any(re.search(r"event=global .*cut_through=[12] ", line) for line in lines), lines
    assert not [line for line in lines if "another header" in line]


@pytest.mark.slow
@pytest.mark.parametrize("point,n", _trials(50, seed=2026))
def test_aggregator_crash_recovers_exactly_50_trials(
    tmp_path: Path, reference_digest: str, point: str, n: int
) -> None:
    _trial(tmp_path, point, n, reference_digest)


@pytest.mark.parametrize("save", ["copy", "live"])
def test_a_killed_island_rejoins_from_its_state(
    tmp_path: Path, reference_digest: str, save: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL one island after a global merge; restarted with the same flags it resumes
    from its saved state (inner optimizer and error feedback included), re-sends
    bit-identical deltas the relay already has, and the run ends on the reference.  The
    state written from a copy (a small model's, the default here) and from the live
    tensors (a large model's; ``HYPERTRAIN_SAVE_COPY_BYTES=0`` makes it so here)."""
    if save == "live":
        monkeypatch.setenv("HYPERTRAIN_SAVE_COPY_BYTES", "0")
    cluster = Cluster(CFG, tmp_path / "run")
    # The temp file a kill in the middle of a save leaves (``atomic_save``'s name for it):
    # the restarted island deletes it before its first save.
    torn = cluster.run_dir / "island-eu-1" / ".island.pt.k2j4h1x9"

    def ready(log: str) -> bool:
        if "kind=global" in log and "step=40 " in log:
            torn.write_bytes(b"t" * 4096)
            return True
        return False

    try:
        again = cluster.kill_island_and_restart("eu-1", ready)
        log = again.log_path.read_text()
        assert "event=resumed" in log
        # (the kill itself may have torn a save too: then it deletes that one as well)
        assert re.search(r"event=swept role=island island=eu-1 files=[12] bytes=\d+", log), log
        assert not list(torn.parent.glob(".island.pt.*"))
    finally:
        cluster.stop()
    digests = {e["digest"] for e in cluster.progress.done.values()}
    assert digests == {reference_digest}

"""An island that pins keys applies no merge without its relay's signed tape head (real
daemons over gRPC on loopback)."""

from __future__ import annotations

from pathlib import Path

from hypertrain.common.config import RunConfig
from hypertrain.common.trust.certs import init_daemons
from hypertrain.common.trust.keys import daemon_key_names

CFG = RunConfig.from_dict(
    {
        "steps": 4,
        "batch_per_island": 2,
        "holdout_windows": 8,
        "topology": {"regions": ["eu"], "islands_per_region": 1, "h_r": 2, "h_g": 4},
    }
)


def test_an_island_refuses_a_merge_from_a_relay_that_keeps_no_tape(  # type: ignore[no-untyped-def]
    cluster_factory, tmp_path: Path
) -> None:
    """The relay and aggregator run without signing keys (no tape, so no receipts); the
    island signs and pins keys: its first merge comes without a receipt, so it stops
    with one line saying so (exit 1), before it applies anything."""
    cluster = cluster_factory(CFG)
    keys = tmp_path / "keys"
    keys.mkdir()
    init_daemons(keys, daemon_key_names(CFG.topology))
    relay = cluster.spawn_region("eu", keys, sign=False)
    state = cluster.run_dir / "island-eu-0"
    island = cluster.spawn(
        "island-eu-0",
        "hypertrain.island",
        "--region",
        "eu",
        "--index",
        "0",
        "--relay",
        relay.wait_listening(),
        "--signing-key",
        str(keys / "island-eu-0.key"),
        "--state-dir",
        str(state),
    )
    assert island.proc.wait(timeout=300) == 1
    log = (cluster.run_dir / "logs" / "island-eu-0.log").read_text()
    assert (
        "the regional merge of step 2 from relay-eu came with 0 receipts, not 1 (relay-eu)" in log
    ), log[-2000:]
    assert not (state / "receipts").exists()
    assert not (state / "island.pt").exists()  # nothing applied, nothing saved

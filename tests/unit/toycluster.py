"""An in-process cluster of toy islands on real files, whose crashed processes restart
(tests of replay, crash points and LAWA share it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hypertrain.common.config import RunConfig
from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.local import Cluster, IslandActor, Observer
from hypertrain.common.toy import ToyIsland
from hypertrain.common.trust.keys import SigningKey, TrustedKeys

CrashHook = Callable[[str], Callable[[str], None]]
"""For each process name, the hook its store calls at every crash point."""


class Restarter(Observer):
    """Restarts a crashed process one virtual second later, from its folder."""

    cluster: Cluster

    def crashed(self, name: str) -> None:
        net, actor = self.cluster.net, self.cluster.actors[name]

        def restart() -> None:
            actor.restart()
            if isinstance(actor, IslandActor) and actor.alive:
                self.cluster.start_training(actor, 1.0)

        net.at(net.now + 1.0, restart)


def toy_cluster(
    cfg: RunConfig,
    run_dir: Path | None,
    keys: dict[str, SigningKey],
    trusted: TrustedKeys,
    crash: CrashHook | None = None,
) -> Cluster:
    """The cluster of ``cfg`` (a toy model): with ``run_dir`` its nodes keep folders and
    tapes signed with ``keys``; without, everything is in memory and untaped."""
    _, theta0 = initial_parameters(cfg)
    restarter = Restarter()
    cluster = Cluster(
        cfg,
        theta0,
        lambda i: ToyIsland(cfg, i, theta0),
        run_dir=run_dir,
        keys=keys if run_dir else {},
        trusted=trusted if run_dir else None,
        observer=restarter,
        **({} if crash is None else {"crash_hook": crash}),  # type: ignore[arg-type]
    )
    restarter.cluster = cluster
    return cluster


def drive(cluster: Cluster) -> Cluster:
    """Train every island and deliver every message until the run is over."""
    for island in cluster.islands.values():
        cluster.start_training(island, 1.0)
    cluster.drive(100_000)
    return cluster

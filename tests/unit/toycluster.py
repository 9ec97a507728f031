"""An in-process cluster of toy islands on real files, whose crashed processes restart
(tests of replay, crash points and LAWA share it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hypertrain.common.config import RunConfig
from hypertrain.common.fragments import run_fragments
from hypertrain.common.roles import initial_parameters
from hypertrain.common.rounds.local import Cluster, Crash, IslandActor, Observer
from hypertrain.common.toy import ToyIsland
from hypertrain.common.trust.keys import SigningKey, TrustedKeys

CrashHook = Callable[[str], Callable[[str], None]]
"""For each process name, the hook its store calls at every crash point."""


def crash_at(point: str, nth: int, fired: list[str]) -> CrashHook:
    """A crash hook under which each process dies the ``nth`` time it passes ``point``
    (its name is added to ``fired`` then)."""
    seen: dict[str, int] = {}

    def hook(name: str) -> Callable[[str], None]:
        def crash(p: str) -> None:
            if p == point:
                seen[name] = seen.get(name, 0) + 1
                if seen[name] == nth:
                    fired.append(name)
                    raise Crash(f"{name} at {p}")

        return crash

    return hook


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
    keep_rounds: int = 0,
) -> Cluster:
    """The cluster of ``cfg`` (a toy model): with ``run_dir`` its nodes keep folders and
    tapes signed with ``keys``, and the checkpoints and inputs of ``keep_rounds`` global
    rounds (0: all); without, everything is in memory and untaped."""
    layout, theta0 = initial_parameters(cfg)
    frags = run_fragments(cfg, layout) if cfg.fragments > 1 else None  # (streaming)
    restarter = Restarter()
    cluster = Cluster(
        cfg,
        theta0,
        lambda i: ToyIsland(cfg, i, theta0, frags),
        fragments=frags,
        run_dir=run_dir,
        keys=keys if run_dir else {},
        trusted=trusted if run_dir else None,
        observer=restarter,
        keep_rounds=keep_rounds,
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

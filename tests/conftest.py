"""Suite-wide settings, applied before any test module imports grpc.

The tests start daemons with subprocess.Popen from a process that also talks
gRPC (test clients).  With gRPC's fork support on, the child forked by Popen
restarts gRPC's poller before exec, finds its epoll fd closed and aborts
(SIGABRT, "epoll_wait error: Bad file descriptor").  This process never needs
gRPC in a forked child, so fork support is off.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def proc_state(pid: int) -> str | None:
    """Process ``pid``'s state letter from /proc/<pid>/stat (R, S, T stopped, Z zombie...),
    or None once it is gone.  The name field may hold spaces and parentheses: the state is
    the field after its last ")"."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat[stat.rindex(")") + 2]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op torch thread (bitwise-stable GEMMs), restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def toy_cluster() -> Callable[..., object]:
    """``make(cfg, run_dir=None)``: the whole cluster of ``cfg`` in one process with toy
    islands (common/rounds/local.py); with ``run_dir``, its folders and tapes there,
    signed with fresh keys (``cluster.keys``) that ``cluster.trusted`` pins."""
    from hypertrain.common.config import RunConfig
    from hypertrain.common.roles import initial_parameters
    from hypertrain.common.rounds.local import Cluster
    from hypertrain.common.toy import ToyIsland
    from hypertrain.common.trust.keys import SigningKey, TrustedKeys, daemon_key_names

    def make(cfg: RunConfig, run_dir: Path | None = None) -> Cluster:
        _, theta0 = initial_parameters(cfg)
        keys = {n: SigningKey.generate(n) for n in daemon_key_names(cfg.topology)}
        return Cluster(
            cfg,
            theta0,
            lambda i: ToyIsland(cfg, i, theta0),
            run_dir=run_dir,
            keys=keys if run_dir else {},
            trusted=TrustedKeys.of(keys.values()) if run_dir else None,
        )

    return make

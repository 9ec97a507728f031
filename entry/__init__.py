"""hypertrain: one language model trained across many datacenters.

Import root of the project.  The user's top-level folders map onto it
(see ``[tool.setuptools.package-dir]`` in pyproject.toml):

    common/              -> hypertrain.common      the pure core (no gRPC)
    services/island/     -> hypertrain.island      island daemon
    services/relay/      -> hypertrain.relay       regional relay daemon
    services/aggregator/ -> hypertrain.aggregator  global aggregator daemon
    services/wire/       -> hypertrain.wire        gRPC transport shared by the daemons
    proto/hypertrain/v1/ -> hypertrain.v1          the wire contract
    experiments/sim/     -> hypertrain.sim         the simulator (engine/, study/, chaos)
"""

import os

# gRPC reads this once, when it is first imported, which is after this package in every
# process of ours.  Its default prints one INFO line per failed TLS handshake, so a flood
# of connections without a certificate would flood a daemon's log: errors only, unless
# the operator sets it (GRPC_VERBOSITY=INFO shows every refused handshake).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
# torch reads this at its first large allocation: a tensor of 2 MiB or more is then aligned
# to and advised for huge pages (MADV_HUGEPAGE), so a fresh model-sized tensor (an island's
# copy of its parameters at each sync, a download buffer, the aggregator's new parameters
# each round) takes one page fault per 2 MiB, not one per 4 KiB: at 1e8 fp32 on this 2-core
# box a fresh tensor filled by a copy took about 0.03 s instead of 0.15 s, and an island
# pushed its delta to the relay's commit about 0.45 s sooner (bench_sync_scale.py part B,
# int8 1x2).  Where the kernel's transparent huge pages are off it changes nothing; an
# operator's own setting (0) is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from hypertrain.common import VERSION as __version__

__all__ = ["__version__"]

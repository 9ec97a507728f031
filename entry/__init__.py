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

from hypertrain.common import VERSION as __version__

__all__ = ["__version__"]

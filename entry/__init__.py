"""hypertrain: one language model trained across many datacenters.

Import root of the project.  The user's top-level folders map onto it
(see ``[tool.setuptools.package-dir]`` in pyproject.toml):

    common/              -> hypertrain.common      the pure core (no gRPC)
    services/island/     -> hypertrain.island      island daemon
    services/relay/      -> hypertrain.relay       regional relay daemon
    services/aggregator/ -> hypertrain.aggregator  global aggregator daemon
    proto/               -> hypertrain.proto       the wire contract
"""

__version__ = "0.1.0"

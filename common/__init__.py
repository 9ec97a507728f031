"""hypertrain.common: the pure core.

Every number that matters (a decoded delta, a regional aggregate, an outer
step, a state digest) is computed by exactly one function here, and every
driver (daemons, in-process reference run, simulator, auditor) calls it.

Invariants: no gRPC or generated protobuf imports (tests/unit/test_layout.py
enforces it); every function is deterministic on CPU; no wall-clock in any
decision that changes numbers.
"""

VERSION = "0.1.0"
"""The package version (also ``hypertrain.__version__``)."""

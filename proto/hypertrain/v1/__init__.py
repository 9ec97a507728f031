"""hypertrain.v1: the wire contract (generated from hypertrain.proto).

The generated modules are committed; tests/unit/test_proto.py fails when
regenerating them from the .proto file changes anything.  Regenerate with
``python scripts/gen_proto.py``.
"""

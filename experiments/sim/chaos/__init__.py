"""hypertrain.sim.chaos: a deterministic fault simulation of the whole cluster.

- ``faults``: what a seed makes go wrong (cluster shape, message delays, losses and
  duplicates, partitions, crashes between events and at crash points).
- ``invariants``: what must hold after every event and at the end.
- ``runner``: one schedule, or thousands on a process pool (``hypertrain sim chaos``).

It drives the real round machines, nodes and island logic through the in-process
transport (common/rounds/local.py); it imports no gRPC.
"""

"""hypertrain.common.rounds: the round engine.

- ``machines``: the relay's and the aggregator's round logic as sans-I/O state machines
  (events in; a decision and effects out, each effect with its tape record).
- ``replay``: rebuild a machine from its tape and published inputs (restart and audit).
- ``store`` / ``node``: a machine made durable (tape, published inputs, checkpoints) and
  its restart.
- ``island``: an island's side of the schedule (push at sync steps, apply pinned merges).
- ``transport``: the interface between levels; ``local``: the in-process transport and
  the whole cluster in one process (``hypertrain run --local``, ``hypertrain sim chaos``).

The schedule itself (which step syncs, merge steps, round numbers) is
``hypertrain.common.schedule``.
"""

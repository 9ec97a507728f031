"""hypertrain.sim.engine: how the simulator trains.

- ``job``: ``SimJob`` (one simulated run, built on the core's ``RunConfig``) and ``JobResult``.
- ``run``: ``run_job``, the outer loop over the core's role classes and the schedule.
- ``replicas`` / ``batched`` / ``stacked``: the per-replica and the batched (stacked model)
  execution paths; they compute the same function.
- ``device``: the CPU/CUDA equivalence check.
"""

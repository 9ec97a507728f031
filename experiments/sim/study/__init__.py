"""hypertrain.sim.study: the pre-registered parity study run on the engine.

- ``design`` / ``prereg``: the registered design, its hash and the registration file.
- ``grid``: the grid runner (workers, resume, caps, no silent loss of a job).
- ``stats`` / ``tdist``: paired t intervals, TOST, power.
- ``summary`` / ``plots``: summary.json, the CSV and the figures the docs quote.
"""

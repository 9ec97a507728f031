"""hypertrain.sim: the parity simulator (docs/design.md §7).

A driver of the same core as the daemons: it trains many replicas in one
process (per-replica or batched as one stacked model), runs the
pre-registered grid, and computes the statistics.  No second implementation
of any codec, aggregation or optimizer lives here.
"""

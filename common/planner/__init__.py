"""hypertrain.common.planner: sizing a deployment from the formulas of docs/design.md
("Planning a run"): batch, steps, outer steps, bandwidth per link class.  Derived, not
measured; nothing in a run depends on it."""

"""hypertrain.common.planner: sizing a deployment from the formulas of docs/design.md
§5 (Planning a run): batch, steps, outer steps, bandwidth per link class.  Derived, not
measured; nothing in a run depends on it."""

"""TensorFlow-free arithmetic of a parallel layout, which the runtime and the planner both import.

  placement  the D x K x T device grid, blocks per stage, bytes per device (`make_plan`)
  schedule   each device's order of forwards and backwards, the bubble, micro-batches in flight
"""

"""tfdist's engine, out of the quarantine: what it does with sharded weights,
written against public TF only (`tfdist.internal` keeps the code that touches
private TF / Keras / keras-hub APIs and calls into here).

- `shards`: a layout's shards assembled into the global tensor and split from it.
- `zero`: ZeRO-1/2's kept whole copy, and a ZeRO-1 gradient's groups and slice.
- `routing`: the routing plan, over which replicas each gradient of a step is summed.
- `placement`: the layout a new variable gets (a tfdist layer's, a slot's, a
  `LayoutMap` weight's with ZeRO, or replicated).
"""

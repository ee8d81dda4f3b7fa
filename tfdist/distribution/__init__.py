"""Bring your Keras or keras-hub model: keras.distribution's API on TensorFlow.

`ModelParallel` and `DataParallel` take Keras's own `DeviceMesh` and
`LayoutMap` (a keras-hub backbone's `get_layout_map(mesh)`, or a hand-written
one) and are `tf.distribute` strategies an unmodified `compile` / `fit` runs
under; `from_keras` turns Keras's own distribution objects into them.

```python
mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"), devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["dense.*kernel"] = (None, "model")
strategy = tfdist.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
with strategy.scope():
    model = ...          # any Keras model
    model.compile(...)
model.fit(...)
```
"""

from keras.distribution import DeviceMesh, LayoutMap  # noqa: F401  (Keras's own)

from tfdist.keras_layouts import KerasLayouts, keras_mesh_shape  # noqa: F401
from tfdist.distribution.model_parallel import DataParallel, ModelParallel, from_keras  # noqa: F401
from tfdist.distribution.rules_layout_map import RulesLayoutMap  # noqa: F401

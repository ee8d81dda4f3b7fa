"""Activation recomputation (gradient checkpointing) that trains exactly like none.

`remat(f)` keeps only `f`'s inputs for the backward pass and runs `f` again
there, under every tfdist strategy (collectives inside `f` included). Unlike
Keras 3.15's TF `remat` (`tf.recompute_grad`), the recomputation sees the same
random numbers as the forward pass (dropout), each variable `f` updates
(seed generators, BatchNormalization statistics, metrics) is updated once,
losses `f` adds (`add_loss`) keep their gradient, and keyword arguments work
under `tf.function`; `tfdist.internal.keras_remat` says how and why.

Every tfdist strategy also makes Keras's own front ends use it:
`keras.remat(f)` and layers built under `keras.RematScope(...)`.

Example:

```python
block = keras.Sequential([keras.layers.Dense(4096, "relu"), keras.layers.Dropout(0.1),
                          keras.layers.Dense(1024)])
outputs = tfdist.remat(block)(inputs, training=True)   # in a layer's call

with keras.RematScope(mode="full"):                     # or Keras's way, any layer
    layer = keras.layers.Dense(4096)
```

`tfdist.models.Transformer` recomputes each encoder and decoder block with
`TransformerConfig(remat=True)` (`--remat` in `scripts/train_nmt.py`).
"""

from tfdist.internal import keras_remat


def remat(f):
    """`f`, recomputed in the backward pass instead of keeping its activations.

    Args:
        f: a function, a layer, or a layer's bound `call`; its arguments may
            hold tensors in nested structures, positionally or by keyword.

    Returns:
        A function with `f`'s signature and results, whose gradients equal
        those of `f` (the same random numbers, one update per variable).
    """
    return keras_remat.remat(f)

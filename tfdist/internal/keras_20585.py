"""Workaround for keras#20585: Keras 3 `fit` under MultiWorkerMirroredStrategy.

Filled in below once the failing calls are pinned down.
"""


def reduce_for_keras(reduce, strategy, reduce_op, value, axis):
    return reduce(reduce_op, value, axis)

"""Keras weight files read slice by slice into sharded variables.

Keras loads a `.weights.h5` file, a `.keras` archive or a keras-hub preset's
weights by reading every tensor whole into host memory and assigning it. Under
a tfdist strategy that would put every global weight (and optimizer slot) on
one host at once; here each device's shard is read from the file on its own.

Private Keras details used here (and only here), each checked by
`tests/internal/test_keras_h5_slices.py` against the installed Keras:

- `keras.src.saving.saving_lib.H5IOStore.__getitem__` (a layer's or optimizer's
  `load_own_variables` reads `store["0"]`, ...): when the caller is one of
  Keras's own `load_own_variables` that only assign what they read (`Layer`, `Dense`, `EinsumDense`, `Embedding`, convolutions,
  optimizers: `_ASSIGNING_LOADERS`), it returns an `H5Slices`, the HDF5
  dataset read on demand, instead of the whole array (the assignment below
  reads it). Any other caller gets Keras's numpy array.
- `keras.src.backend.common.variables.Variable.assign`: an `H5Slices` assigned
  to a variable whose value is a tfdist sharded variable goes to it unread;
  the sharded variable reads its shards' slices
  (`shard_routing.ShardedVariable`). Any other target reads it whole first.
- `keras.src.saving.saving_lib.is_memory_sufficient`: False under a tfdist
  strategy, so `load_model` extracts a `.keras` archive's weights file to disk
  and reads it lazily instead of copying the whole file into memory.

Keras's legacy whole-model `.h5` format is read whole (Keras's own code).
"""

import sys

import ml_dtypes
import numpy as np
import tensorflow as tf

from tfdist import runtime


class H5Slices:
    """An HDF5 dataset of a Keras weights file, read on demand.

    Attributes:
        shape: the dataset's shape (the whole weight's).
        dtype: the numpy dtype of what `read` returns.
    """

    def __init__(self, dataset):
        self._dataset = dataset
        self.shape = tuple(dataset.shape)
        bfloat16 = dataset.attrs.get("dtype", None) == "bfloat16"
        self.dtype = np.dtype(ml_dtypes.bfloat16) if bfloat16 else dataset.dtype
        self.ndim = len(self.shape)

    def read(self, slices=()):
        """The part of the dataset `slices` (a tuple of slices) selects, as a numpy array."""
        return np.asarray(self._dataset[tuple(slices)]).astype(self.dtype, copy=False)

    def __array__(self, dtype=None, copy=None):
        whole = self.read()
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, key):
        return self.read(key if isinstance(key, tuple) else (key,))

    def __len__(self):
        return self.shape[0]


def _lazy():
    return runtime.current_runtime() is not None


def _assigning_loaders():
    """Code objects of Keras's `load_own_variables` that only assign what they read."""
    import keras
    from keras.src.layers.convolutional.base_conv import BaseConv

    owners = (keras.layers.Layer, keras.layers.Dense, keras.layers.EinsumDense,
              keras.layers.Embedding, BaseConv, keras.optimizers.Optimizer)
    return {owner.load_own_variables.__code__ for owner in owners}


_ASSIGNING_LOADERS = set()


def _entry_getitem(original):
    def getitem(self, key):
        if sys._getframe(1).f_code not in _ASSIGNING_LOADERS:
            return original(self, key)
        from keras.src.saving import saving_lib

        value = saving_lib.safe_get_h5_dataset(self._h5_entry_group, key)
        return H5Slices(value) if hasattr(value, "attrs") else original(self, key)

    getitem._tfdist_original = original
    return getitem


def _variable_assign(original):
    def assign(self, value):
        if isinstance(value, H5Slices):
            target = getattr(self, "_value", None)
            if getattr(target, "_tfdist_assign_slices", False) and (
                    tf.distribute.in_cross_replica_context() or not tf.distribute.has_strategy()):
                if tuple(value.shape) != tuple(self.shape):
                    raise ValueError(
                        f"Cannot load a weight of shape {value.shape} into variable "
                        f"{self.path!r} of shape {tuple(self.shape)}.")
                target.assign(value)  # each shard reads its own slice
                return value
            value = np.asarray(value)
        return original(self, value)

    assign._tfdist_original = original
    return assign


def _memory_sufficient(original):
    def is_memory_sufficient(model):
        return False if _lazy() else original(model)

    is_memory_sufficient._tfdist_original = original
    return is_memory_sufficient


def _replace(owner, name, wrap):
    current = getattr(owner, name) if isinstance(owner, type(np)) else owner.__dict__[name]
    if getattr(current, "_tfdist_original", None) is None:
        setattr(owner, name, wrap(current))


def install() -> None:
    """Installs the three hooks (idempotent)."""
    from keras.src.backend.common import variables
    from keras.src.saving import saving_lib

    _ASSIGNING_LOADERS.update(_assigning_loaders())
    _replace(saving_lib.H5IOStore, "__getitem__", _entry_getitem)
    _replace(variables.Variable, "assign", _variable_assign)
    _replace(saving_lib, "is_memory_sufficient", _memory_sufficient)
    tf.register_tensor_conversion_function(
        H5Slices, lambda value, dtype=None, name=None, as_ref=False:
        tf.convert_to_tensor(np.asarray(value), dtype=dtype, name=name))

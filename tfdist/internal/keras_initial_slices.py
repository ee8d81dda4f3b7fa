"""One shard of a Keras random initializer's value, drawn without the whole value.

Keras's random initializers on TensorFlow draw with TF's stateless random ops
(`tf.random.stateless_uniform`, `..._normal`, `..._truncated_normal`) from the
seed `draw_seed(initializer.seed)`. Those ops run the Philox counter-based
generator: the value at flat (row-major) position `i` depends only on the key and
on the counter advanced by `i // per_group * counters_per_group` (the kernel fills
groups of 4 outputs, 2 for float64, each from its own counter; truncated normal
reserves 256 counters per group for its rejection loop). So any box of the
global value can be drawn alone, bit for bit: contiguous runs of it from the
counter where each run starts, then the initializer's own scale and shift.

`slice_drawer` mirrors, for the Keras classes whose `__call__` is Keras's own:
`RandomNormal`, `RandomUniform`, `TruncatedNormal` and `VarianceScaling`
(Glorot, He, LeCun: the scale from the *global* shape's fans). Anything else
(`Orthogonal`, whose QR needs the whole matrix; a custom initializer) gets None.
Where TF picks another generator than Philox (XLA on TPU), a box is cut from
the whole value drawn on its device.

Private APIs used here (and only here): `keras.src.random.seed_generator.draw_seed`,
`keras.src.backend.tensorflow.random._cast_seed`,
`keras.src.initializers.random_initializers.compute_fans`,
`tensorflow.python.ops.random_ops_util.get_key_counter_alg` and the raw
`StatelessRandom*V2` ops. `SOURCES` fingerprints the Keras and TF source
mirrored; where the installed source differs, `slice_drawer` returns None (the
value is drawn whole, as before), and `tests/internal/test_keras_initial_slices.py`
fails, asking for the mirror to be checked.
"""

import functools
import importlib
import math
from typing import Callable, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from tfdist.internal import sources

# {(module, qualified name): sha256 of its source}: the code mirrored here.
SOURCES = {
    ("keras.src.initializers.random_initializers", "RandomNormal.__call__"):
        "e873d2fc41cc8621b164fbb1857f4c2585e4406f4b92ccbf4b287a733be9fece",
    ("keras.src.initializers.random_initializers", "RandomUniform.__call__"):
        "01c9054d776967fe449905d7fa157117dd6ad4d43df14b279058062e10b540a9",
    ("keras.src.initializers.random_initializers", "TruncatedNormal.__call__"):
        "1d0c163b9670f4c196455b50b932bc53c6803bc458c48d8028e4e3c557ea2920",
    ("keras.src.initializers.random_initializers", "VarianceScaling.__call__"):
        "baf2b9943e296a5c9af9fbc2409bd7a94bede1dc3bc5aa21be8aed19d333e0b2",
    ("keras.src.backend.tensorflow.random", "normal"):
        "58c75c5521f3eb1add77fe0e273eea9735959fb7db3849fb03c0f550fa84642f",
    ("keras.src.backend.tensorflow.random", "uniform"):
        "9ca69437a855029f707d67e6cb5dcf670c259a31cb09e416fed52b0320aa985b",
    ("keras.src.backend.tensorflow.random", "truncated_normal"):
        "75682b9b641f18d1567b16f176f9a133c8ef8017fd24d447f03f0375cf20cf52",
    ("tensorflow.python.ops.stateless_random_ops", "stateless_random_uniform"):
        "1e640124fe6dc0ea7746a7c7068d46dce2c1535f4f1187ce94525fa95e2c7903",
    ("tensorflow.python.ops.stateless_random_ops", "stateless_random_normal"):
        "12e7c3983042a3dfcb32cc66fa4a562c5e201d8e743229942009a41a25a712c7",
    ("tensorflow.python.ops.stateless_random_ops", "stateless_truncated_normal"):
        "78f85fe5fb07a89d1015639e35479ff8fd0365a376d209fcdd3bed0fd3188520",
}

# TF's RNG_ALG_PHILOX, and RNG_ALG_AUTO_SELECT (Philox on CPU and GPU; XLA on TPU
# picks its own): the algorithm whose counter layout is mirrored.
_PHILOX, _AUTO_SELECT = 1, 3


def source_hash(module: str, qualname: str) -> str:
    """sha256 of the installed source of `module.qualname`."""
    target = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return sources.source_sha256(target)


@functools.cache  # the installed sources do not change within a process
def mirrored_sources_match() -> bool:
    """Whether every source in `SOURCES` is the one mirrored here."""
    return all(source_hash(module, name) == digest
               for (module, name), digest in SOURCES.items())


def _distribution(initializer, shape) -> Optional[Tuple[str, float, float]]:
    """(kind, scale, shift) of `initializer(shape)`: its value is `raw * scale + shift`
    for TF's raw `kind` draw ("uniform" in [0, 1), "normal", "truncated"); None when
    the initializer is not one mirrored here."""
    inits = keras.initializers
    call = type(initializer).__call__
    if call is inits.RandomNormal.__call__:
        return "normal", initializer.stddev, initializer.mean
    if call is inits.TruncatedNormal.__call__:
        return "truncated", initializer.stddev, initializer.mean
    if call is inits.RandomUniform.__call__:
        return "uniform", (initializer.minval, initializer.maxval), None
    if call is not inits.VarianceScaling.__call__:
        return None
    from keras.src.initializers.random_initializers import compute_fans

    scale = initializer.scale
    fan_in, fan_out = compute_fans(tuple(shape), input_axes=initializer.input_axes,
                                   output_axes=initializer.output_axes)
    if initializer.mode == "fan_in":
        scale /= max(1.0, fan_in)
    elif initializer.mode == "fan_out":
        scale /= max(1.0, fan_out)
    else:
        scale /= max(1.0, (fan_in + fan_out) / 2.0)
    if initializer.distribution == "truncated_normal":
        return "truncated", math.sqrt(scale) / 0.87962566103423978, 0.0
    if initializer.distribution == "untruncated_normal":
        return "normal", math.sqrt(scale), 0.0
    limit = math.sqrt(3.0 * scale)
    return "uniform", (-limit, limit), None


def draw_seed(initializer) -> tf.Tensor:
    """The int32 seed Keras's TF backend draws `initializer`'s value from (advancing
    its `SeedGenerator`, as one call of the initializer does)."""
    from keras.src.backend.tensorflow.random import _cast_seed
    from keras.src.random.seed_generator import draw_seed as keras_draw_seed

    return _cast_seed(keras_draw_seed(initializer.seed))


def slice_drawer(initializer, shape: Sequence[int], dtype
                 ) -> Optional[Callable[[tf.Tensor, Sequence[slice]], tf.Tensor]]:
    """`draw(seed, box)`: `initializer(shape, dtype)[box]` drawn alone, bit for bit,
    from `seed = draw_seed(initializer)` (one seed for all of a value's boxes); a
    box is one `slice(start, stop)` per dimension. None where not mirrored."""
    if not mirrored_sources_match():
        return None
    distribution = _distribution(initializer, shape)
    if distribution is None:
        return None
    kind, scale, shift = distribution
    dtype = tf.as_dtype(keras.backend.standardize_dtype(dtype or keras.config.floatx()))
    if not dtype.is_floating:
        return None
    shape = tuple(int(n) for n in shape)

    def draw(seed, box):
        begin = tuple(s.start for s in box)
        size = tuple(s.stop - s.start for s in box)
        raw = _raw_box(kind, dtype, seed, shape, begin, size)
        if kind == "uniform":  # as tf.random.stateless_uniform
            low, high = tf.cast(scale[0], dtype), tf.cast(scale[1], dtype)
            return tf.add(raw * (high - low), low)
        # as tf.random.stateless_normal / stateless_truncated_normal
        return tf.add(raw * tf.convert_to_tensor(scale, dtype=dtype),
                      tf.convert_to_tensor(shift, dtype=dtype))

    return draw


_RAW_OPS = {
    "uniform": tf.raw_ops.StatelessRandomUniformV2,
    "normal": tf.raw_ops.StatelessRandomNormalV2,
    "truncated": tf.raw_ops.StatelessTruncatedNormalV2,
}


def _group(kind: str, dtype) -> Tuple[int, int]:
    """(outputs per group, counters per group) of TF's Philox kernels for `kind`."""
    per_group = 2 if dtype == tf.float64 else 4
    return per_group, (per_group * 64 if kind == "truncated" else 1)


def _raw_box(kind, dtype, seed, shape, begin, size) -> tf.Tensor:
    """The box `[begin, begin + size)` of TF's raw draw of `shape` from `seed`.

    Rows of the box (its elements along the last split dimension and the whole
    dimensions after it) are contiguous in the flat value; consecutive rows are
    drawn together in runs of about the box's size, so the transient memory is
    about one box.
    """
    if 0 in size:
        return tf.zeros(size, dtype)
    key, counter, alg = _key_counter_alg(seed)
    if int(alg) not in (_PHILOX, _AUTO_SELECT) or "TPU" in _current_device():
        # another generator: draw the whole value and cut the box
        whole = _RAW_OPS[kind](shape=shape, key=key, counter=counter, alg=alg, dtype=dtype)
        return whole[tuple(slice(b, b + n) for b, n in zip(begin, size))]
    counter = [int(c) for c in counter.numpy()]
    split = [d for d, (n, s) in enumerate(zip(shape, size)) if n != s]
    last = split[-1] if split else 0
    inner = math.prod(shape[last + 1:])
    stride, first, length = shape[last] * inner, begin[last] * inner, size[last] * inner
    outer = np.meshgrid(*[np.arange(b, b + n) for b, n in zip(begin[:last], size[:last])],
                        indexing="ij")
    rows = np.ravel_multi_index(outer, shape[:last]).ravel() if last else np.zeros(1, int)
    per_run = max(1, len(rows) * length // stride)  # rows drawn together
    pieces, i = [], 0
    while i < len(rows):
        j = int(np.searchsorted(rows, rows[i] + per_run))
        span = int(rows[j - 1] - rows[i]) + 1
        start = int(rows[i]) * stride + first
        if span > 1:  # rows `stride` apart, each `length` long (the last row's tail drawn too)
            run = tf.reshape(_raw_run(kind, dtype, key, counter, alg, start, span * stride),
                             [span, stride])[:, :length]
        else:
            run = _raw_run(kind, dtype, key, counter, alg, start, length)[None]
        if j - i != span:  # rows of the run outside the box
            run = tf.gather(run, rows[i:j] - rows[i])
        pieces.append(run)
        i = j
    return tf.reshape(tf.concat(pieces, 0) if len(pieces) > 1 else pieces[0], size)


def _key_counter_alg(seed):
    from tensorflow.python.ops import random_ops_util

    return random_ops_util.get_key_counter_alg(seed, None)


def _current_device() -> str:
    from tensorflow.python.eager import context

    return context.context().device_name or ""


def _raw_run(kind, dtype, key, counter, alg, start: int, count: int) -> tf.Tensor:
    """`count` raw values from flat position `start`, from Philox's counter there."""
    per_group, counters = _group(kind, dtype)
    head = start % per_group
    low = counter[0] + (start - head) // per_group * counters  # 128-bit counter, low word first
    shifted = tf.constant([low % 2 ** 64, (counter[1] + low // 2 ** 64) % 2 ** 64], tf.uint64)
    raw = _RAW_OPS[kind](shape=[head + count], key=key, counter=shifted, alg=alg, dtype=dtype)
    return raw[head:]

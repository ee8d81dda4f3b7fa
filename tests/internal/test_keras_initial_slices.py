"""tfdist.internal.keras_initial_slices: any box of a Keras random initializer's
value, drawn alone, equals the same box of the whole value bit for bit."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.internal import keras_initial_slices

INITIALIZERS = {
    "normal": lambda seed: keras.initializers.RandomNormal(mean=0.3, stddev=2.0, seed=seed),
    "uniform": lambda seed: keras.initializers.RandomUniform(-1.0, 3.0, seed=seed),
    "truncated": lambda seed: keras.initializers.TruncatedNormal(mean=-1.0, stddev=0.5,
                                                                 seed=seed),
    "glorot_uniform": lambda seed: keras.initializers.GlorotUniform(seed=seed),
    "he_normal": lambda seed: keras.initializers.HeNormal(seed=seed),  # truncated
    "fan_avg_normal": lambda seed: keras.initializers.VarianceScaling(
        2.0, "fan_avg", "untruncated_normal", seed=seed),
}

# (global shape, box): unaligned starts, a split last dimension (rows apart),
# every dimension split, one contiguous range, a box of one row.
BOXES = [
    ((37, 53), (slice(0, 37), slice(27, 53))),
    ((6, 8, 10), (slice(2, 4), slice(2, 6), slice(3, 7))),
    ((1001,), (slice(333, 778),)),
    ((64, 30), (slice(17, 49), slice(0, 30))),
    ((3, 4, 50), (slice(1, 2), slice(0, 4), slice(0, 25))),
]


def test_the_mirrored_sources_are_the_installed_ones():
    """Fails when Keras or TF changes what the slices mirror: check the mirror
    (`tfdist/internal/keras_initial_slices.py`), then update `SOURCES`."""
    for (module, name), digest in keras_initial_slices.SOURCES.items():
        assert keras_initial_slices.source_hash(module, name) == digest, (module, name)
    assert keras_initial_slices.mirrored_sources_match()


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("name", sorted(INITIALIZERS))
def test_each_box_equals_that_box_of_the_whole_value(name, dtype):
    for shape, box in BOXES:
        initializer = INITIALIZERS[name](seed=11)
        whole = initializer(shape, dtype=dtype)
        draw = keras_initial_slices.slice_drawer(initializer, shape, dtype)
        part = draw(keras_initial_slices.draw_seed(initializer), box)
        assert part.dtype == whole.dtype
        np.testing.assert_array_equal(part.numpy(), whole.numpy()[box], err_msg=str(shape))


def test_a_large_truncated_normal_box_equals_the_whole_values():
    """Enough values that the kernel's rejection loop and thread shards both matter."""
    initializer = keras.initializers.TruncatedNormal(seed=5)
    shape = (512, 1000)
    whole = initializer(shape).numpy()
    draw = keras_initial_slices.slice_drawer(initializer, shape, "float32")
    for box in [(slice(0, 512), slice(500, 1000)), (slice(129, 387), slice(250, 750))]:
        np.testing.assert_array_equal(draw(keras_initial_slices.draw_seed(initializer), box),
                                      whole[box])


def test_seed_generators_and_unseeded_initializers_draw_one_seed_per_value():
    """A `SeedGenerator` advances once per value, as one call of the initializer does."""
    shape, box = (40, 60), (slice(0, 40), slice(30, 60))
    for make in (lambda: keras.random.SeedGenerator(7), lambda: None):
        keras.utils.set_random_seed(1)
        initializer = keras.initializers.GlorotNormal(seed=make())
        expected = [initializer(shape).numpy()[box] for _ in range(2)]
        keras.utils.set_random_seed(1)
        initializer = keras.initializers.GlorotNormal(seed=make())
        draw = keras_initial_slices.slice_drawer(initializer, shape, "float32")
        for value in expected:
            seed = keras_initial_slices.draw_seed(initializer)
            np.testing.assert_array_equal(draw(seed, box), value)


def test_a_box_is_drawn_in_runs_of_about_its_own_size():
    """Memory: no raw draw is larger than about the box (never the whole value)."""
    initializer = keras.initializers.RandomUniform(seed=3)
    shape = (256, 4096)
    sizes = []
    original = keras_initial_slices._RAW_OPS["uniform"]

    def recording(shape, **kwargs):
        sizes.append(int(np.prod(shape)))
        return original(shape=shape, **kwargs)

    keras_initial_slices._RAW_OPS["uniform"] = recording
    try:
        draw = keras_initial_slices.slice_drawer(initializer, shape, "float32")
        for box in [(slice(0, 256), slice(1024, 2048)), (slice(64, 128), slice(0, 4096))]:
            part = draw(keras_initial_slices.draw_seed(initializer), box)
            assert max(sizes) <= part.shape.num_elements() + 4096, (box, sizes)
            sizes.clear()
    finally:
        keras_initial_slices._RAW_OPS["uniform"] = original
    np.testing.assert_array_equal(part, initializer(shape).numpy()[64:128])


def test_initializers_not_mirrored_get_none():
    class Custom(keras.initializers.GlorotUniform):
        def __call__(self, shape, dtype=None):
            return super().__call__(shape, dtype) * 2

    for initializer in (keras.initializers.Orthogonal(seed=1), Custom(seed=1),
                        keras.initializers.Zeros(), keras.initializers.Identity()):
        assert keras_initial_slices.slice_drawer(initializer, (4, 4), "float32") is None
    assert keras_initial_slices.slice_drawer(keras.initializers.HeUniform(seed=1), (4, 4),
                                             "int32") is None


def test_shards_of_a_padded_layout_are_the_split_value_with_zero_padding():
    """`keras_variables.shard_maker`: one seed per variable, each device's box, and the
    padding of a layout whose split dimension does not divide (tfdist's class axis)."""
    from tfdist.internal.keras_variables import shard_maker
    from tfdist.core.shards import split_global
    from tfdist.mesh import Mesh

    layout = Mesh.parse("data:2;model:4", "d_model:data;classes:model").tensor_layout(
        ("d_model", "classes"), (6, 10), pad=True)
    assert layout.padded_shape == (6, 12)
    initializer = keras.initializers.HeUniform(seed=keras.random.SeedGenerator(2))
    make = shard_maker(initializer, layout, "float32")
    shards = [make(i) for i in range(8)]  # the generator advances once, for all of them
    expected = split_global(layout, keras.initializers.HeUniform(
        seed=keras.random.SeedGenerator(2))((6, 10)))
    for shard, value in zip(shards, expected):
        np.testing.assert_array_equal(shard, value)
    assert not np.any(shards[3].numpy()[:, 1:])  # columns 10 and 11: padding

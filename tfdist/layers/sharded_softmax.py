"""Extreme classification: a softmax whose classes are split over devices.

Letters: b = per-replica batch, M = size of the mesh axis `classes` maps to,
C = number of classes, C_l = ceil(C / M) classes per device, d = d_model.

    features [b, d] -> all_gather over the class axis -> [b*M, d]
    logits   [b*M, C_l] = features @ kernel[:, shard]      (never [b, C])

Every reduction over classes is a collective over *scalars per row*: the
global max (pmax), the global sum of exponentials (psum), the target logit
from the shard that owns it (psum), and for label smoothing the global sum of
logits (psum) divided by the **global** C. When C does not divide by M the
last shard is padded; padding is masked out of the max, the sums, the
smoothing and the predictions. Reductions run in float32.

Class-centre sampling (Partial FC, `sample_rate < 1`, training only): each
shard keeps every class that is a label of the gathered batch plus random
negatives up to `ceil(sample_rate * C_l)`, multiplies by those kernel columns
only and computes the softmax over the sampled classes of every shard on the
compact `[b*M, kept]` logits; the head adds that loss itself (`add_loss`).

Each replica returns losses and predictions for its own b rows only.
"""

import keras
import tensorflow as tf

from tfdist import collectives
from tfdist.layers.weights import (
    add_sharded_weight,
    check_mesh,
    check_positive_int,
    disable_jit_on_multi_device_mesh,
    sharded_mesh_axis,
)

_NEG = -1e30


def class_axis(logical_axis: str = "classes"):
    """The mesh axis (size > 1) the logical axis is split over, or None."""
    mesh = collectives.current_mesh()
    axis = mesh.mesh_axis(logical_axis)
    return axis if mesh.axis_size(axis) > 1 else None


def _own_rows(x, axis):
    """This replica's rows of a batch gathered over `axis` ([b*M, ...] -> [b, ...])."""
    size = collectives.axis_size(axis)
    if size == 1:
        return x
    rows = tf.shape(x)[0] // size
    return x[collectives.axis_index(axis) * rows:(collectives.axis_index(axis) + 1) * rows]


def _shard_stats(logits, num_classes, axis):
    """Masked float32 logits, validity mask, class offset and global log-sum-exp."""
    logits = tf.cast(logits, "float32")
    local = logits.shape[-1]
    offset = collectives.axis_index(axis) * local
    valid = (offset + tf.range(local)) < num_classes  # [C_l]: not padding
    masked = tf.where(valid, logits, _NEG)
    row_max = collectives.pmax(tf.reduce_max(masked, axis=-1), axis)  # [rows]
    sum_exp = collectives.psum(
        tf.reduce_sum(tf.where(valid, tf.exp(masked - row_max[:, None]), 0.0), -1), axis)
    lse = tf.math.log(sum_exp) + row_max  # [rows]
    return masked, valid, offset, lse


def sharded_cross_entropy(labels, logits, num_classes, axis, label_smoothing=0.0):
    """Per-example softmax cross-entropy from logit shards.

    Args:
        labels: int class ids `[b]` of this replica's rows.
        logits: this device's logit shard `[b*M, C_l]` (rows gathered over `axis`).
        num_classes: the global C.
        axis: the mesh axis the classes are split over (None: one shard).
        label_smoothing: epsilon; targets are `(1 - eps) * one_hot + eps / C`.

    Returns:
        `[b]` float32 losses for this replica's rows.
    """
    labels = tf.cast(tf.reshape(labels, [-1]), "int32")
    all_labels = collectives.all_gather(labels, axis, dim=0)  # [b*M]
    local = logits.shape[-1]
    offset = collectives.axis_index(axis) * local
    local_label, owned = _in_shard(all_labels, offset, local)
    mask = None
    if local * collectives.axis_size(axis) != num_classes:  # the last shard's padding
        mask = tf.where((offset + tf.range(local)) < num_classes, 0.0, float("-inf"))
    return softmax_cross_entropy_on_shards(logits, tf.where(owned, local_label, 0), owned, axis,
                                           label_smoothing, column_mask=mask)


def softmax_cross_entropy_on_shards(logits, target_column, owned, axis, label_smoothing=0.0,
                                    column_mask=None):
    """Softmax cross-entropy over the classes of all shards of `axis`.

    One fused pass forward (max, exp, sum over the shard; collectives only over
    scalars per row) and a hand-written gradient, `softmax - target`, reusing
    the forward's exponentials: the `[rows, n]` shard is read a few times and
    never copied by autodiff's generic rules.

    Args:
        logits: this device's `[rows, n]` logits (rows gathered over `axis`).
        target_column: `[rows]` column of each row's label in this shard
            (any value where not `owned`).
        owned: `[rows]` whether this shard holds the row's label.
        label_smoothing: epsilon over every class of every shard (the
            smoothing's C is the count of columns that are not masked).
        column_mask: optional `[n]` float32, 0 for a class, -inf for padding.

    Returns:
        `[b]` float32 losses for this replica's rows.
    """
    dtype = logits.dtype
    where = tf.stack([tf.range(tf.shape(logits)[0]), target_column], -1)
    eps = float(label_smoothing)

    @tf.custom_gradient
    def loss_fn(z):
        z = tf.cast(z, "float32")
        if column_mask is not None:
            z = z + column_mask
        row_max = collectives.pmax(tf.reduce_max(z, axis=-1), axis)  # [rows]
        e = tf.exp(z - row_max[:, None])
        sum_exp = collectives.psum(tf.reduce_sum(e, axis=-1), axis)
        lse = tf.math.log(sum_exp) + row_max
        target = collectives.psum(tf.where(owned, tf.gather_nd(z, where), 0.0), axis)
        loss = lse - target
        if eps:
            valid = z > _NEG
            sums = tf.stack([tf.reduce_sum(tf.where(valid, z, 0.0), axis=-1),
                             tf.reduce_sum(tf.cast(valid, "float32"), axis=-1)], axis=-1)
            total, count = tf.unstack(collectives.psum(sums, axis), axis=-1)
            loss = (1.0 - eps) * loss + eps * (lse - total / count)

        def grad(dy):
            # dy is the upstream gradient of this replica's rows only; every
            # shard needs it for all gathered rows: place it, sum over the axis.
            d = dy if axis is None else collectives.psum(_place_rows(dy, axis), axis)
            dz = e * (d / sum_exp)[:, None]
            dz = tf.tensor_scatter_nd_sub(dz, where, tf.where(owned, (1.0 - eps) * d, 0.0))
            if eps:
                dz = dz - tf.where(valid, (eps * d / count)[:, None], 0.0)
            return tf.cast(dz, dtype)

        return _own_rows(loss, axis), grad

    return loss_fn(logits)


def _in_shard(labels, offset, local):
    """Labels relative to the shard starting at class `offset`, and whether it holds them."""
    local_label = labels - offset
    return local_label, tf.logical_and(local_label >= 0, local_label < local)


def _place_rows(x, axis):
    """`x` ([b], this replica's rows) at its slot of the gathered `[b*M]`, zeros elsewhere."""
    size = collectives.axis_size(axis)
    index = collectives.axis_index(axis)
    b = tf.shape(x)[0]
    return tf.concat([tf.zeros([index * b], x.dtype), x,
                      tf.zeros([(size - 1 - index) * b], x.dtype)], axis=0)


def sample_classes(all_labels, offset, local, num_classes, sample_rate, seed=None):
    """Partial FC class-centre sampling on one shard of `local` columns.

    Args:
        all_labels: int32 labels of every row the shard sees (gathered batch).
        offset: global id of the shard's first column.
        local: columns per shard, C_l (the last shard may hold padding).
        num_classes: the global C.
        sample_rate: fraction of the shard's real classes to keep.
        seed: a stateless seed (int32 `[2]`) for the negatives; None: TF's
            global generator.

    Returns:
        int32 column indices, sorted: every positive class (a label of
        `all_labels` in this shard) plus uniformly drawn negatives, in all
        `max(ceil(sample_rate * real), positives)` columns.
    """
    local_label, in_shard = _in_shard(all_labels, offset, local)
    positive = tf.scatter_nd(tf.where(in_shard, local_label, 0)[:, None],
                             tf.cast(in_shard, "int32"), [local]) > 0  # [C_l]
    real = (offset + tf.range(local)) < num_classes
    num_real = tf.reduce_sum(tf.cast(real, "int32"))
    keep = tf.cast(tf.math.ceil(sample_rate * tf.cast(num_real, "float32")), "int32")
    keep = tf.minimum(tf.maximum(keep, tf.reduce_sum(tf.cast(positive, "int32"))), num_real)
    uniform = (tf.random.uniform([local]) if seed is None
               else tf.random.stateless_uniform([local], seed=seed))
    score = tf.where(positive, 2.0, tf.where(real, uniform, -1.0))
    _, ids = tf.math.top_k(score, k=keep)
    return tf.sort(ids)


def sharded_top_k(logits, k, num_classes, axis):
    """Global top-k class ids and probabilities without gathering the logits.

    Each device takes its local top-k; the k*M candidates per row are gathered
    (ids and logits only) and merged.

    Returns:
        `(ids [b, k] int32, probabilities [b, k] float32)` for this replica's rows.
    """
    masked, _, offset, lse = _shard_stats(logits, num_classes, axis)
    k_local = min(k, masked.shape[-1])
    values, ids = tf.math.top_k(masked, k=k_local)  # [rows, k_local]
    values = collectives.all_gather(values, axis, dim=-1)  # [rows, k_local*M]
    ids = collectives.all_gather(ids + offset, axis, dim=-1)
    best, where = tf.math.top_k(values, k=k)
    ids = tf.gather(ids, where, batch_dims=1)
    probs = tf.exp(best - lse[:, None])
    return _own_rows(ids, axis), _own_rows(probs, axis)


@keras.saving.register_keras_serializable(package="tfdist")
class ShardedSoftmax(keras.layers.Layer):
    """A classifier head whose kernel `[d_model, classes]` is split over classes.

    Returns logits only as shards: `[batch * M, ceil(C / M)]` per device under a
    mesh that splits `classes` (or `vocab`, per `kernel_axes`), `[batch, C]`
    elsewhere. Train it with `ShardedSparseCategoricalCrossentropy`, measure it
    with `ShardedTopKAccuracy`, predict with `ShardedTopK`.

    Args:
        num_classes: C (need not divide by the mesh axis; the last shard is padded).
        kernel_axes: logical axes of the kernel, `("d_model", "classes")` or
            `("d_model", "vocab")` for a language model.
        use_bias: whether to add a bias.
        kernel_initializer, bias_initializer: Keras initializers.
        tied_embedding: a `ShardedEmbedding` whose table `[vocab, d_model]`
            serves as the (transposed) kernel: tied input/output embeddings.
            Its vocabulary must equal `num_classes`; it is split like the
            classes (rule `vocab:...`, with `kernel_axes=("d_model", "vocab")`).
        sample_rate: class-centre sampling (Partial FC) for training: in
            `call(x, labels=y, training=True)` each shard computes logits only
            for the batch's positive classes plus random negatives, about
            `sample_rate` of its classes, and adds the softmax cross-entropy
            over those classes with `add_loss` (compile the training model with
            `loss=None`). 1.0 (default) computes every class. Evaluation and
            prediction (`training=False` or no labels) always use every class.
        label_smoothing: epsilon of the sampled training loss.
        seed: seed of the sampling's `keras.random.SeedGenerator` (its state is
            in the layer's variables: checkpoints restore it).

    Example:

    ```python
    strategy = MeshStrategy("data:1;model:4", "classes:model")
    with strategy.scope():
        x = inputs = keras.Input((256,))
        logits = ShardedSoftmax(1_000_000, name="head")(x)    # 250,000 per device
        model = keras.Model(inputs, logits)
        model.compile("adam", ShardedSparseCategoricalCrossentropy(1_000_000),
                      metrics=[ShardedTopKAccuracy(1_000_000, k=5)])
    ```
    """

    def __init__(self, num_classes, kernel_axes=("d_model", "classes"), use_bias=True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 tied_embedding=None, sample_rate=1.0, label_smoothing=0.0, seed=None,
                 **kwargs):
        super().__init__(**kwargs)
        if tied_embedding is not None and tied_embedding.input_dim != num_classes:
            raise ValueError(
                f"The tied embedding has a vocabulary of {tied_embedding.input_dim}, "
                f"but num_classes={num_classes}."
            )
        self.tied_embedding = tied_embedding
        self.num_classes = check_positive_int("num_classes", num_classes)
        self.kernel_axes = tuple(kernel_axes)
        if len(self.kernel_axes) != 2 or self.kernel_axes[1] not in ("classes", "vocab"):
            raise ValueError(
                f"`kernel_axes` must be (input_axis, 'classes' or 'vocab'). "
                f"Received: kernel_axes={kernel_axes!r}"
            )
        if not 0 < sample_rate <= 1:
            raise ValueError(f"`sample_rate` must be in (0, 1]. Received: sample_rate={sample_rate!r}")
        self.sample_rate = float(sample_rate)
        self.label_smoothing = float(label_smoothing)
        self.seed = seed
        # Partial FC's negatives: a Keras generator, so checkpoints restore it.
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.weight_layouts = {}
        disable_jit_on_multi_device_mesh(self)
        if self.sample_rate < 1:
            self.supports_jit = False  # the sampled column count is data-dependent

    def build(self, input_shape):
        if self.tied_embedding is not None:
            if not self.tied_embedding.built:
                self.tied_embedding.build(None)
            self.kernel = None
            self._axis = self.tied_embedding._vocab_axis
        else:
            self.kernel = add_sharded_weight(
                self, "kernel", (int(input_shape[-1]), self.num_classes), self.kernel_axes,
                pad=True, initializer=self.kernel_initializer)
            self._axis = sharded_mesh_axis(self.weight_layouts["kernel"], 1)
        self.bias = None
        if self.use_bias:
            self.bias = add_sharded_weight(
                self, "bias", (self.num_classes,), (self.kernel_axes[1],), pad=True,
                initializer=self.bias_initializer)

    def call(self, inputs, labels=None, training=None):
        check_mesh(self)
        x = collectives.all_gather(tf.convert_to_tensor(inputs), self._axis, dim=0)  # [b*M, d]
        if training and labels is not None and self.sample_rate < 1:
            return self._sampled_training(x, labels)
        if self.kernel is None:  # tied: the embedding's table shard [C_l, d]
            logits = tf.matmul(x, self.tied_embedding.embeddings, transpose_b=True)
        else:
            logits = tf.matmul(x, self.kernel)  # [b*M, C_l]
        if self.bias is not None:
            logits = logits + self.bias
        return logits

    def _sampled_training(self, x, labels):
        """Partial FC: the loss over the sampled classes, added with `add_loss`.

        Returns the sampled logits `[b*M, kept]` (columns: this shard's sampled
        classes in id order); the loss is already added, so compile the
        training model with `loss=None`.
        """
        if self.kernel is None:
            kernel = tf.transpose(tf.convert_to_tensor(self.tied_embedding.embeddings))
        else:
            kernel = tf.convert_to_tensor(self.kernel)  # a dense read: dense gradients
        local = kernel.shape[-1]
        labels = tf.cast(tf.reshape(labels, [-1]), "int32")
        all_labels = collectives.all_gather(labels, self._axis)
        shard = collectives.axis_index(self._axis)
        offset = shard * local
        # One draw per step from the layer's generator, made distinct per shard.
        seed = tf.cast(self.seed_generator.next(), "int32") + tf.stack([0, tf.cast(shard, "int32")])
        ids = sample_classes(all_labels, offset, local, self.num_classes, self.sample_rate, seed)
        # Gathered on axis 1 so their gradients are dense (non-lazy Adam).
        logits = tf.matmul(x, tf.gather(kernel, ids, axis=1))  # [b*M, kept]
        if self.bias is not None:
            logits = logits + tf.gather(tf.convert_to_tensor(self.bias)[None], ids, axis=1)
        local_label, owned = _in_shard(all_labels, offset, local)
        column = tf.searchsorted(ids[None], tf.where(owned, local_label, 0)[None])[0]
        losses = softmax_cross_entropy_on_shards(
            logits, tf.where(owned, column, 0), owned, self._axis, self.label_smoothing)
        self.add_loss(tf.reduce_mean(losses))
        return logits

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.num_classes,)

    def get_config(self):
        config = super().get_config()
        config.update(
            num_classes=self.num_classes,
            kernel_axes=list(self.kernel_axes),
            use_bias=self.use_bias,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
            sample_rate=self.sample_rate,
            label_smoothing=self.label_smoothing,
            seed=self.seed,
        )
        return config


@keras.saving.register_keras_serializable(package="tfdist")
class ShardedSparseCategoricalCrossentropy(keras.losses.Loss):
    """Softmax cross-entropy on `ShardedSoftmax` logit shards, integer labels.

    Args:
        num_classes: the global C.
        label_smoothing: epsilon, applied over the global C classes.
        class_axis: the logical axis the classes are declared on.
    """

    def __init__(self, num_classes, label_smoothing=0.0, class_axis="classes",
                 name="sharded_sparse_categorical_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.num_classes = check_positive_int("num_classes", num_classes)
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"`label_smoothing` must be in [0, 1). Received: {label_smoothing!r}")
        self.label_smoothing = float(label_smoothing)
        self.class_axis = class_axis

    def call(self, y_true, y_pred):
        return sharded_cross_entropy(y_true, y_pred, self.num_classes,
                                     class_axis(self.class_axis), self.label_smoothing)

    def get_config(self):
        config = super().get_config()
        config.update(num_classes=self.num_classes, label_smoothing=self.label_smoothing,
                      class_axis=self.class_axis)
        return config


@keras.saving.register_keras_serializable(package="tfdist")
class ShardedTopKAccuracy(keras.metrics.Mean):
    """Fraction of rows whose label is among the top-k classes of the logit shards."""

    def __init__(self, num_classes, k=1, class_axis="classes", name=None, **kwargs):
        super().__init__(name=name or f"top{k}_accuracy", **kwargs)
        self.num_classes, self.k, self.class_axis = num_classes, k, class_axis

    def update_state(self, y_true, y_pred, sample_weight=None):
        ids, _ = sharded_top_k(y_pred, self.k, self.num_classes, class_axis(self.class_axis))
        labels = tf.cast(tf.reshape(y_true, [-1, 1]), ids.dtype)
        hit = tf.reduce_any(tf.equal(ids, labels), axis=-1)
        return super().update_state(tf.cast(hit, self.dtype), sample_weight=sample_weight)

    def get_config(self):
        return dict(num_classes=self.num_classes, k=self.k, class_axis=self.class_axis,
                    name=self.name)


@keras.saving.register_keras_serializable(package="tfdist")
class ShardedTopK(keras.layers.Layer):
    """Top-k class ids and probabilities from `ShardedSoftmax` logit shards.

    Output: `(ids [batch, k], probabilities [batch, k])` for each replica's own rows.
    """

    def __init__(self, num_classes, k=5, class_axis="classes", **kwargs):
        super().__init__(**kwargs)
        self.num_classes = check_positive_int("num_classes", num_classes)
        self.k = check_positive_int("k", k)
        self.class_axis = class_axis
        disable_jit_on_multi_device_mesh(self)

    def call(self, logits):
        return sharded_top_k(logits, self.k, self.num_classes, class_axis(self.class_axis))

    def compute_output_spec(self, logits):
        batch = logits.shape[0]
        return (keras.KerasTensor((batch, self.k), dtype="int32"),
                keras.KerasTensor((batch, self.k), dtype="float32"))

    def get_config(self):
        config = super().get_config()
        config.update(num_classes=self.num_classes, k=self.k, class_axis=self.class_axis)
        return config

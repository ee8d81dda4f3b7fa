"""TFCollectiveBackend: TensorFlow's V2 collective ops among a strategy's devices.

The devices may be virtual CPUs of one process, GPUs (NCCL), or the devices
of every task of a single-controller cluster (the ops of each device run on
its task; tasks exchange data over gRPC, ring-style).

Its `batch_all_reduce` fuses many small tensors into a few flat buckets (as
Horovod's fusion buffer and PyTorch DDP's gradient buckets do): tensors of
one dtype are flattened and concatenated, in the order given, into buckets of
at most `bucket_bytes` (a tensor larger than that gets a bucket of its own),
so one collective moves each bucket. Gradients are passed last layer first,
so the first bucket is ready early in the backward pass and TF's executor can
start its collective while earlier layers still compute.

    buckets = plan_buckets(tensors, bucket_bytes=25 << 20)   # [[0, 1], [2], ...]
    flat = pack(tensors, bucket)                              # [sum of sizes]
    parts = unpack(flat, [tensors[i] for i in bucket])        # original shapes
"""

import contextlib
import itertools
import threading
from typing import List, Sequence, Tuple

import tensorflow as tf

from tfdist.comm.base import Group, check_permutation, in_supported_dtype, is_involution
from tfdist.comm.shape_keys import DEFAULT_MAX_SHAPES, ShapeIds, host_of

_MAX_INSTANCE_KEY = (1 << 31) - 1  # instance keys are int32
DEFAULT_BUCKET_BYTES = 25 << 20  # PyTorch DDP's default bucket_cap_mb


class TFCollectiveBackend:
    """Issues TF collective ops among groups of one strategy's devices.

    Each device has an ordering token (a resource variable) so that the
    collectives of a device run in the order they were traced; without it,
    collectives on virtual CPUs hang. Group keys are unique per backend and
    device group; instance keys are unique per logical collective and, for a
    collective whose shape is known only at run time, per shape of the step's
    inputs (`step_shapes`, `tfdist.comm.shape_keys`).

    Args:
        devices: device strings, index `i` being mesh device `i`.
        timeout_seconds: a collective that waits longer than this fails
            instead of hanging; 0 (the default) waits forever. TF implements
            the timeout with one sleeping thread per collective *execution*
            that lives for the whole timeout, so a long timeout on a busy
            training loop piles up thousands of threads: use it to debug hangs.
        bucket_bytes: the largest fused bucket of `batch_all_reduce`.
        ring_subdivisions: chunks per device of TF's ring all-reduce
            (`max_subdivs_per_device`); TF's default (-1) sends too few, too
            large chunks to keep both directions of a ring busy: 8 doubled the
            bytes/s of a 33.6 MB all-reduce between two processes here
            (bench/scaling.py). Ignored by NCCL.
        max_shapes: distinct input shapes one traced step may meet (each
            costs TF one record per collective whose shape varies).

    On GPUs the ops ask for NCCL (`communication_hint="nccl"`); elsewhere TF
    picks its ring implementation.
    """

    _key_lock = threading.Lock()
    _next_group_key = itertools.count(7001)
    _next_instance_base = 1 << 20

    def __init__(self, devices: Sequence[str], timeout_seconds: float = 0.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, ring_subdivisions: int = 8,
                 max_shapes: int = DEFAULT_MAX_SHAPES):
        self.devices = tuple(devices)
        self.timeout_seconds = float(timeout_seconds)
        self.bucket_bytes = int(bucket_bytes)
        self.ring_subdivisions = int(ring_subdivisions)
        self._shape_ids = ShapeIds(host_of(self.devices[0]), max_shapes)
        self._shape_id = None  # the current step's shape id while its collectives are traced
        gpus = all("GPU" in d.upper().rsplit("/", 1)[-1] for d in self.devices)
        self.communication_hint = "nccl" if gpus else "auto"
        with tf.init_scope():
            self._tokens = []
            for d in self.devices:
                with tf.device(d):
                    self._tokens.append(
                        tf.Variable(0.0, trainable=False, name="tfdist_ordering_token")
                    )
        self._group_keys = {}
        self._instance_keys = {}
        self._sequence = {}

    def _token(self, replica: int):
        return self._tokens[replica].handle

    def _keys(self, replica: int, group: Tuple[int, ...]) -> Tuple[int, int]:
        if tf.executing_eagerly():
            raise RuntimeError(
                "tfdist collectives run inside tf.function only: MirroredStrategy-"
                "style replicas run one after another in eager mode, so a "
                "collective would wait forever. Compile the Keras model with "
                "run_eagerly=False (the default) or wrap strategy.run in "
                "tf.function."
            )
        with self._key_lock:
            if group not in self._group_keys:
                self._group_keys[group] = next(self._next_group_key)
            group_key = self._group_keys[group]
            seq = self._sequence.get((group, replica), 0)
            self._sequence[(group, replica)] = seq + 1
            if (group, seq) not in self._instance_keys:
                self._instance_keys[(group, seq)] = self._reserve_instance_keys()
            return group_key, self._instance_keys[(group, seq)]

    def _reserve_instance_keys(self) -> int:
        """The first of `max_shapes` consecutive fresh instance keys (caller holds the lock)."""
        base = TFCollectiveBackend._next_instance_base
        if base + self._shape_ids.max_shapes > _MAX_INSTANCE_KEY:
            raise RuntimeError(
                "tfdist has used up TensorFlow's int32 collective instance keys in this "
                "process (too many traced collectives times max_shapes); use a smaller "
                "max_shapes or fewer retraces.")
        TFCollectiveBackend._next_instance_base = base + self._shape_ids.max_shapes
        return base

    @contextlib.contextmanager
    def step_shapes(self, tensors):
        """Collectives traced inside are keyed for the run-time shapes of `tensors`.

        The strategy wraps each traced step (`_call_for_each_replica`) in this,
        with every replica's input tensors: a collective whose input shape is not
        static takes its key's slot for the step's shape id (see
        `tfdist.comm.shape_keys`). Outside it, such a collective keeps one key
        and must always see one shape.
        """
        tensors = [t for t in tensors if isinstance(t, tf.Tensor)]
        # One device: no collective runs (every group has one member), so no key is
        # needed, and the table's string ops would keep a one-device step from XLA.
        if tf.executing_eagerly() or not tensors or len(self.devices) == 1 or \
                all(t.shape.is_fully_defined() for t in tensors):
            yield
            return
        previous = self._shape_id
        self._shape_id = self._shape_ids.shape_id(ShapeIds.new_trace(), tensors)
        try:
            yield
        finally:
            self._shape_id = previous

    def resync(self) -> None:
        """Puts every device of each group at the same next collective.

        Keys are drawn per device in trace order. A trace that failed in Python
        part-way (an error in one replica after some collectives) leaves the
        devices of a group at different positions, and the next trace's
        collectives would pair wrong instances and hang. The strategy calls
        this before every trace of a step: all devices continue from the
        furthest position, on fresh instance keys.
        """
        with self._key_lock:
            top = {}
            for (group, _), seq in self._sequence.items():
                top[group] = max(top.get(group, 0), seq)
            for group, replica in list(self._sequence):
                self._sequence[(group, replica)] = top[group]
            for group in top:  # devices of the group that never drew a key
                for replica in group:
                    self._sequence[(group, replica)] = top[group]

    def _common(self, replica, group, x, shape_varies=False):
        group_key, instance_key = self._keys(replica, group)
        if shape_varies and not x.shape.is_fully_defined():
            instance_key = tf.constant(instance_key, tf.int32) + \
                self._shape_ids.own_shape_id(instance_key, x, self.devices[replica])
        elif self._shape_id is not None and not x.shape.is_fully_defined():
            instance_key = tf.constant(instance_key, tf.int32) + self._shape_id
        return dict(
            group_size=len(group),
            group_key=group_key,
            instance_key=instance_key,
            ordering_token=[self._token(replica)],
            communication_hint=self.communication_hint,
            timeout_seconds=self.timeout_seconds,
        )

    def all_reduce(self, x, replica: int, group: Group, merge_op: str = "Add"):
        """`merge_op` ("Add", "Max", "Min", "Mul") of `x` over the devices of `group`."""
        with tf.device(self.devices[replica]):  # also the identity: no copy to device 0
            if len(group) == 1:
                return tf.identity(x)
            return in_supported_dtype(x, lambda x: tf.raw_ops.CollectiveReduceV2(
                input=x,
                merge_op=merge_op,
                final_op="Id",
                max_subdivs_per_device=self.ring_subdivisions,
                **self._common(replica, group, x),
            ))

    def all_gather(self, x, replica: int, group: Group):
        """Concatenation along dimension 0 of `x` from each device of `group`."""
        with tf.device(self.devices[replica]):
            if len(group) == 1:
                return tf.identity(x)
            return in_supported_dtype(x, lambda x: tf.raw_ops.CollectiveGatherV2(
                input=x, **self._common(replica, group, x)))

    def all_to_all(self, x, replica: int, group: Group, shape_varies: bool = False):
        """Splits dimension 0 into `len(group)` parts, part j to device j.

        `shape_varies`: the instance is keyed by `x`'s own run-time shape (a
        lookup in the shape table per execution) instead of the step's.
        """
        with tf.device(self.devices[replica]):
            if len(group) == 1:
                return tf.identity(x)
            return in_supported_dtype(x, lambda x: tf.raw_ops.CollectiveAllToAllV2(
                input=x, **self._common(replica, group, x, shape_varies)))

    def permute(self, x, replica: int, group: Group, source: Sequence[int]):
        """`x` of device `group[source[k]]` at device `group[k]`.

        TF has no point-to-point collective. A permutation that swaps pairs
        (the ring attention schedule's rounds) runs as one two-device gather
        per pair, each device receiving exactly its partner's `x`; any other
        permutation runs as an all-to-all whose parts for devices other than
        the receiver are zeros (`n - 1` times the bytes of a send).
        """
        source = check_permutation(source, len(group))
        k = group.index(replica)
        with tf.device(self.devices[replica]):
            if source[k] == k and is_involution(source):
                return tf.identity(x)
            if is_involution(source):
                pair = tuple(sorted((replica, group[source[k]])))
                both = self.all_gather(x[None], replica, pair)
                return both[pair.index(group[source[k]])]
            target = source.index(k)
            parts = tf.stack([x if j == target else tf.zeros_like(x) for j in range(len(group))])
            return self.all_to_all(parts, replica, group)[source[k]]

    def batch_all_reduce(self, tensors, replica: int, group: Group):
        """Sums over `group`, one collective per fused bucket (tensor fusion: `fused`)."""
        with tf.device(self.devices[replica]):
            if len(group) == 1:
                return [tf.identity(t) for t in tensors]
            return fused(lambda flat: self.all_reduce(flat, replica, group),
                                tensors, self.bucket_bytes)


# -- tensor fusion ---------------------------------------------------------------


def plan_buckets(tensors: Sequence, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> List[List[int]]:
    """Indices of `tensors` grouped into buckets: one dtype each, in order, <= `bucket_bytes`.

    Shapes must be fully known (they are for gradients of built weights).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive; received {bucket_bytes}.")
    open_buckets = {}  # dtype -> (indices, bytes)
    buckets = []
    for i, t in enumerate(tensors):
        size = t.shape.num_elements()
        if size is None:
            raise ValueError(f"Tensor fusion needs static shapes; tensor {i} has shape {t.shape}.")
        nbytes = size * t.dtype.size
        indices, used = open_buckets.get(t.dtype, ([], 0))
        if indices and used + nbytes > bucket_bytes:
            buckets.append(indices)
            indices, used = [], 0
        indices.append(i)
        open_buckets[t.dtype] = (indices, used + nbytes)
    buckets.extend(indices for indices, _ in open_buckets.values() if indices)
    return sorted(buckets, key=lambda b: b[0])


def pack(tensors: Sequence, bucket: Sequence[int]):
    """The tensors of `bucket` flattened and concatenated: `[sum of their sizes]`."""
    if len(bucket) == 1:
        return tf.reshape(tensors[bucket[0]], [-1])
    return tf.concat([tf.reshape(tensors[i], [-1]) for i in bucket], axis=0)


def unpack(flat, like: Sequence) -> List:
    """Splits `flat` back into tensors shaped like `like` (same order)."""
    if len(like) == 1:
        return [tf.reshape(flat, like[0].shape)]
    sizes = [t.shape.num_elements() for t in like]
    return [tf.reshape(part, t.shape) for part, t in zip(tf.split(flat, sizes), like)]


def fused(reduce_one, tensors: Sequence, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> List:
    """`reduce_one(flat)` applied to each bucket of `tensors`; results in `tensors`' order."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    out = [None] * len(tensors)
    for bucket in plan_buckets(tensors, bucket_bytes):
        reduced = reduce_one(pack(tensors, bucket))
        for i, part in zip(bucket, unpack(reduced, [tensors[i] for i in bucket])):
            out[i] = part
    return out

"""Tensor fusion: many small tensors packed into a few flat buckets.

Like Horovod's fusion buffer and PyTorch DDP's gradient buckets: tensors of
one dtype are flattened and concatenated, in the order given, into buckets of
at most `bucket_bytes` (a tensor larger than that gets a bucket of its own),
so one collective moves each bucket. Gradients are passed last layer first,
so the first bucket is ready early in the backward pass and TF's executor can
start its collective while earlier layers still compute.

    buckets = plan_buckets(tensors, bucket_bytes=25 << 20)   # [[0, 1], [2], ...]
    flat = pack(tensors, bucket)                              # [sum of sizes]
    parts = unpack(flat, [tensors[i] for i in bucket])        # original shapes
"""

from typing import List, Sequence

import tensorflow as tf

DEFAULT_BUCKET_BYTES = 25 << 20  # PyTorch DDP's default bucket_cap_mb


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

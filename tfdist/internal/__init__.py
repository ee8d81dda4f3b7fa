"""Quarantine: the only place where tfdist touches private TF/Keras APIs.

Why: tf.distribute has no public extension point for a strategy whose variables
are shards rather than mirrors, nor for routing a sharded weight's gradient to
only the replicas that hold the same shard. `MeshExtended` subclasses
`MirroredExtended` (tensorflow.python.distribute) and `ShardedVariable`
subclasses `MirroredVariable`; both override private hooks (`_create_variable`,
`_batch_reduce_to`, `_update`, `_get_cross_replica`, ...). Every hook used is
exercised by `tests/internal/`, so a TF upgrade that moves one fails there
first, loudly.
"""

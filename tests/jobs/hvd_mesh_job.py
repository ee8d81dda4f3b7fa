"""A job for tests/cluster: tfdist's sharded layers on a mesh over Horovod ranks.

    horovodrun -np N --gloo -H localhost:N python tests/jobs/hvd_mesh_job.py MESH [MODELS]

Builds `HorovodStrategy(MESH, layout)` (rank r = mesh device r) and, for each
model (token_mlp: ShardedEmbedding + column/row ShardedDense; xc_head:
ShardedSoftmax; moe: two MoE layers, expert choice (fixed-shape all-to-all)
and dropless top-2 with shared experts (all-to-all of a run-time shape),
experts split, a second strategy on the same ranks; top-k capacity routing is
the same exchange, tested in-process), compares forward, loss,
gradients, weights and Adam slots after 6 to 10 steps with the single-device
reference, printing one report line per model and rank. Then trains with
`BackupAndRestore` (every rank gathers, rank 0 writes) and checks the global
checkpoint against the weights, and prints the local shard shape of a
sharded kernel.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

mesh = sys.argv[1]
models = sys.argv[2].split(",") if len(sys.argv) > 2 else ["token_mlp", "xc_head", "moe"]

from tfdist.strategies.horovod import HorovodStrategy  # noqa: E402

strategy = HorovodStrategy(mesh_shape=mesh,
                           layout="batch:data;d_ff:model;vocab:model;classes:model")

import job_cases  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfdist import checkpoint  # noqa: E402
from tfdist.callbacks import BackupAndRestore  # noqa: E402
from tfdist.layers import MoE  # noqa: E402
from tfdist.models import build_token_mlp, make_copy_task  # noqa: E402
from tfdist.testing.equivalence import assert_equivalent  # noqa: E402

rank = strategy.rank
adam = job_cases.adam

if "token_mlp" in models:
    print(f"rank {rank} token_mlp {mesh}: {job_cases.token_mlp(strategy)}", flush=True)

if "plain_embedding" in models:
    print(f"rank {rank} plain_embedding {mesh}: {job_cases.plain_embedding(strategy)}", flush=True)

if "keras_options" in models:
    print(f"rank {rank} keras_options {mesh}: {job_cases.keras_options(strategy)}", flush=True)

for case in ("sharded_options", "fit_options", "partial_batches", "remat", "sequence"):
    if case in models:
        print(f"rank {rank} {case} {mesh}: {getattr(job_cases, case)(strategy)}", flush=True)

if "mixed_bfloat16" in models:
    print(f"rank {rank} mixed_bfloat16 {mesh}: {job_cases.mixed_bfloat16(strategy)}", flush=True)

if "xc_head" in models:
    print(f"rank {rank} xc_head {mesh}: {job_cases.xc_head(strategy)}", flush=True)

if "zero" in models:  # ZeRO-1 over the ranks (a second strategy, data parallel)
    report = job_cases.zero(strategy, lambda stage: HorovodStrategy(zero_stage=stage),
                            stages=(1,))
    print(f"rank {rank} zero {mesh}: {report}", flush=True)

if "moe" in models:
    def moe_model():  # expert choice; dropless top-2 with shared experts
        x = inputs = keras.Input((2, 8))
        for name, kwargs in (("moe_ec", dict(routing="expert_choice", capacity_factor=2.0)),
                             ("moe_dropless", dict(top_k=2, dropless=True, shared_d_ff=8))):
            x = x + MoE(4, 16, min_capacity=1, group_size=4, aux_loss_coef=1e-1, name=name,
                        **kwargs)(x)
        return keras.Model(inputs, x)

    rng = np.random.default_rng(0)
    xm = rng.normal(size=(10 * 8, 2, 8)).astype("float32")
    ym = np.tanh(xm[..., ::-1] * 2.0).astype("float32")
    experts = HorovodStrategy(mesh_shape=mesh, layout="batch:data;experts:model")
    report = assert_equivalent(moe_model, experts, xm, ym, loss=keras.losses.MeanSquaredError(),
                               optimizer=adam, batch_size=8, steps=6, rtol=1e-5)
    print(f"rank {rank} moe {mesh}: {report}", flush=True)

# Global checkpoints: every rank gathers, rank 0 writes; shards stay per rank.
x, y = make_copy_task(4 * 16)
keras.utils.set_random_seed(0)
with strategy.scope():
    model = build_token_mlp()
    model.compile(adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
backup = os.environ.get("TFDIST_TEST_BACKUP_DIR") or tempfile.mkdtemp()
model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
          callbacks=[BackupAndRestore(backup, delete_checkpoint=False)])
weights = model.get_weights()  # all ranks: gathers the shards
kernel = model.get_layer("ffn1_in").kernel
local_shape = tuple(kernel.value.values[0].shape)
if rank == 0:
    plain = build_token_mlp()  # outside the strategy: a plain Keras model
    checkpoint.load(plain, os.path.join(backup, "epoch-1.npz"), with_optimizer=False)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(plain.get_weights(), weights))
    backups = sorted(f for f in os.listdir(backup) if f.endswith(".npz"))
    print(f"rank 0 checkpoint {mesh}: files {backups} diff {diff:.1e}", flush=True)
# Sharded checkpoints, beside the backups in the shared directory (other ranks may be
# writing there while rank 0 lists the backups above): each rank writes its own shards, rank 0
# merges; a plain Keras model on rank 0 reads weights and optimizer state from it.
state = job_cases.training_state(model)  # all ranks: gathers
sharded = os.path.join(backup, "final.shards")
wrote = checkpoint.save(model, sharded)
if rank == 0:
    diff = job_cases.plain_token_mlp_diff(sharded, state)
    parts = sorted(os.listdir(os.path.join(sharded, "gen-1")))
    print(f"rank 0 sharded {mesh}: wrote {wrote} files {parts} diff {diff:.1e}", flush=True)
print(f"rank {rank} shard {mesh}: ffn1_in kernel global {tuple(kernel.shape)} "
      f"local {local_shape}", flush=True)

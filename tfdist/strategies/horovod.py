"""HorovodStrategy: data parallelism over Horovod ranks for an unmodified Keras 3 `fit`."""

import os
from typing import Optional

import tensorflow as tf

from tfdist.comm.horovod import HorovodBackend, init_with_process_sets
from tfdist.internal import (hooks, install_keras_hooks, install_layout_map_hooks,
                             keras_loop_reads)
from tfdist.keras_layouts import KerasLayouts
from tfdist.internal.horovod_replicas import HorovodExtended
from tfdist.internal.keras_reduce import reduce_for_keras
from tfdist.mesh import Mesh, MeshShape
from tfdist.runtime import MeshRuntime

_COMPRESSIONS = ("none", "fp16")
GLOO_TIMEOUT_SECONDS = 30  # HOROVOD_GLOO_TIMEOUT_SECONDS unless the environment sets it


class HorovodStrategy(MeshRuntime, tf.distribute.Strategy):
    """One replica per Horovod process; gradients by Horovod's ring all-reduce.

    Launch with `horovodrun -np N --gloo -H localhost:N python script.py`
    (`-H host1:8,host2:8` on a cluster). Initial weights come from rank 0,
    each rank trains on its slice of every global batch, gradients are summed
    with `hvd.grouped_allreduce` (optionally fp16-compressed), metric results
    read after a step or by `evaluate` are global and identical on every rank.
    Write checkpoints and logs where `strategy.rank == 0`
    (`tfdist.callbacks.is_chief`).

    With `mesh_shape` and `layout`, rank `r` is device `r` of the mesh: tfdist's
    sharded layers (ShardedDense, ShardedSoftmax, MoE...) keep one shard per
    rank and talk over Horovod process sets of the mesh axes (registered at
    `hvd.init`, so create the strategy before anything else initialises
    Horovod); a sharded weight's gradient is summed over the ranks holding the
    same shard only. Global reads of sharded weights (`get_weights`,
    `save_weights`, `tfdist.checkpoint.save`) all-gather the shards, so
    every rank must make them together: save with
    `tfdist.callbacks.BackupAndRestore` (all ranks gather, rank 0 writes), not
    with a rank-0-only Keras `ModelCheckpoint`.

    Args:
        compression: "none" or "fp16" (gradients travel as float16).
        reduction: "sum" (ring all-reduce) or "adasum" (Horovod's Adasum;
            needs a Horovod built with MPI, else a clear error).
        device: this process's device (default: GPU `local_rank` if there are
            GPUs, else the CPU).
        mesh_shape: Mesh-TF mesh shape over the ranks, e.g. `"data:2;model:4"`
            for 8 ranks; its sizes must multiply to the number of ranks.
            Default: `"data:<ranks>"` (pure data parallelism).
        layout: Mesh-TF layout rules, e.g. `"batch:data;d_ff:model"`.
        layout_map: a `keras.distribution.LayoutMap` instead of `mesh_shape`
            and `layout` (its `DeviceMesh` gives the mesh's axis names and
            sizes; its devices are the ranks): any Keras model's variables are
            split by path, as `tfdist.distribution.ModelParallel` does (a
            tfdist model's `get_layout_map` brings its layout rules too).
            Each rank makes its own shards of split weights as `ModelParallel`
            does (random ones from rank 0's seed); a weight whose initializer
            needs the whole value starts from rank 0's, broadcast.
        batch_dim_name: with `layout_map`, the mesh axis named after the batch
            (default: the first).
        reshard_after_forward: with `layout_map`, as `ModelParallel`'s.
        prefetch: with `layout_map`, as `ModelParallel`'s.
        zero_stage: ZeRO over the batch axis of the ranks, as
            `tfdist.distribution.ModelParallel`'s; with `layout_map`, or alone
            (then the ranks are one axis `data` and every Keras weight is
            stored split over it).
        batch_shares: unequal devices (pure data parallelism only): each rank's
            share of every global batch, e.g. `[1, 3]` (rank 1 takes three
            quarters), or "equal" to start even and let
            `tfdist.callbacks.SpeedProportionalBatches` re-measure the ranks'
            speeds and move rows to the faster during training. Every rank reads
            the whole global batch and its step cuts its contiguous share; the
            losses count every rank's rows, so training equals one process on
            the same global batches whatever the shares (HAP / dynamic batch
            sizing; a slow rank does less work instead of everyone waiting).

    Example (4 ranks, Megatron MLP split over pairs of ranks):

    ```python
    strategy = HorovodStrategy(mesh_shape="data:2;model:2", layout="batch:data;d_ff:model")
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((16,)),
            ShardedDense(64, kernel_axes=("d_model", "d_ff"), output_sharded=True),
            ShardedDense(16, kernel_axes=("d_ff", "d_model"), input_sharded=True)])
        model.compile("adam", "mse")
    model.fit(x, y, batch_size=32)
    ```
    """

    _collective_key_base = 90000  # read by MirroredExtended; TF's own collectives are unused

    def __init__(self, compression: str = "none", device: Optional[str] = None,
                 reduction: str = "sum", mesh_shape=None, layout=None, layout_map=None,
                 batch_dim_name: Optional[str] = None, reshard_after_forward: bool = True,
                 zero_stage: int = 0,
                 prefetch: bool = False, batch_shares=None):
        hooks.verify()  # the installed TF / Keras / keras-hub are the ones tfdist hooks into
        if compression not in _COMPRESSIONS:
            raise ValueError(f"compression must be one of {list(_COMPRESSIONS)}; "
                             f"received compression={compression!r}.")
        try:
            import horovod.tensorflow as hvd
        except ImportError as e:
            raise ImportError(
                "HorovodStrategy needs Horovod built against this TensorFlow: run "
                "scripts/install_horovod.sh.") from e
        if reduction not in ("sum", "adasum"):
            raise ValueError(f"reduction must be 'sum' or 'adasum'; received {reduction!r}.")
        if reduction == "adasum" and not hvd.mpi_built():
            raise ValueError("reduction='adasum' needs Horovod built with MPI; this build has "
                             "only Gloo (scripts/install_horovod.sh builds without MPI). "
                             "Use reduction='sum'.")
        keras_layouts = None
        if layout_map is not None:
            if mesh_shape is not None or layout is not None:
                raise ValueError("HorovodStrategy takes a layout_map or a mesh_shape and layout, "
                                 f"not both; received layout_map and mesh_shape={mesh_shape!r}, "
                                 f"layout={layout!r}.")
            keras_layouts = KerasLayouts.for_mesh(layout_map.device_mesh, layout_map,
                                                  batch_dim_name,
                                                  reshard_after_forward=reshard_after_forward,
                                                  zero_stage=zero_stage, prefetch=prefetch)
            mesh_shape = keras_layouts.mesh_shape
            layout = getattr(layout_map, "layout_rules", None)  # a RulesLayoutMap's
        elif zero_stage:
            if mesh_shape is not None or layout is not None:
                raise ValueError(
                    f"HorovodStrategy's zero_stage applies to Keras weights laid out by path: "
                    f"give it a layout_map, or no mesh_shape (pure data parallelism over the "
                    f"ranks); received mesh_shape={mesh_shape!r}, layout={layout!r}.")
            KerasLayouts(None, MeshShape.parse("data:1"), "data", zero_stage=zero_stage)  # checked
        mesh = None if mesh_shape is None else Mesh.parse(mesh_shape, layout)  # checked first
        if batch_shares is not None and (keras_layouts is not None or zero_stage or
                                         (mesh is not None and not mesh.splits_only_batch)):
            raise ValueError(
                f"batch_shares needs pure data parallelism (layers that exchange activations "
                f"need every rank to hold the same rows); this strategy has "
                + (f"a layout_map over {mesh_shape}" if keras_layouts is not None else
                   f"zero_stage={zero_stage}" if mesh is None else str(mesh))
                + ". Drop batch_shares or the model axes.")
        # A lost peer fails Gloo's connect/collective waits after this many seconds, not never.
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(GLOO_TIMEOUT_SECONDS))
        if mesh is None:
            hvd.init()
            mesh = Mesh.parse(f"data:{hvd.size()}", layout)
            if zero_stage:
                keras_layouts = KerasLayouts(None, mesh.shape, "data", zero_stage=zero_stage)
        codec = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
        backend = HorovodBackend(hvd, init_with_process_sets(hvd, mesh), compression=codec,
                                 adasum=reduction == "adasum")
        if device is None:
            gpus = tf.config.list_logical_devices("GPU")
            device = gpus[hvd.local_rank() % len(gpus)].name if gpus else "/cpu:0"
        install_keras_hooks()
        if keras_layouts is not None:
            install_layout_map_hooks()
        super().__init__(HorovodExtended(self, hvd, device, mesh, backend, keras_layouts))
        self.hvd = hvd
        self.mesh = mesh
        self._backend = backend
        if batch_shares is not None:  # pure data parallelism: checked before Horovod started
            self.extended.enable_batch_shares()
            self.set_batch_shares([1.0] * hvd.size() if batch_shares == "equal"
                                  else batch_shares)

    def set_batch_shares(self, shares) -> None:
        """Each rank's share of every global batch from the next step on (proportions,
        one per rank, all > 0; every rank must set the same). Needs `batch_shares`."""
        if not self.extended.batch_shares:
            raise ValueError("set_batch_shares needs HorovodStrategy(batch_shares=...).")
        shares = [float(s) for s in shares]
        if len(shares) != self.hvd.size() or not all(s > 0 for s in shares):
            raise ValueError(f"batch_shares must be {self.hvd.size()} positive proportions, "
                             f"one per rank; received {shares}.")
        total, bounds = sum(shares), [0.0]
        for s in shares:
            bounds.append(bounds[-1] + s / total)
        bounds[-1] = 1.0
        self.extended.set_batch_bounds(bounds)
        self.batch_shares = tuple(s / total for s in shares)

    def check_collective(self, what: str) -> None:  # MeshRuntime
        keras_loop_reads.check_no_loop(what)  # not inside a loop of a Keras call

    def reduce(self, reduce_op, value, axis):
        # Keras's symbolic build reduces the first batch, which replicas may hold
        # unevenly: answered locally (tfdist.internal.keras_reduce).
        return reduce_for_keras(super().reduce, self, reduce_op, value, axis)

    @property
    def backend(self) -> HorovodBackend:
        return self._backend

    @property
    def is_chief(self) -> bool:
        return self.hvd.rank() == 0

    @property
    def rank(self) -> int:
        return self.hvd.rank()

    @property
    def size(self) -> int:
        return self.hvd.size()

    @property
    def process_index(self) -> int:  # MeshRuntime
        return self.hvd.rank()

    @property
    def process_count(self) -> int:  # MeshRuntime
        return self.hvd.size()

    def barrier(self, name: str) -> None:  # MeshRuntime
        """Returns when every rank has called it (one tiny all-reduce)."""
        self.hvd.allreduce(tf.zeros([], tf.float32), name=f"{name}_{self.extended._next()}")

    def gather_local_results(self, local):
        """Every rank's list `local` of numpy arrays (same shapes), concatenated in rank order.

        A collective: every rank calls it together.
        """
        import numpy as np

        stacked = self.hvd.allgather(tf.convert_to_tensor(np.stack(local)),
                                     name=f"tfdist_results_{self.extended._next()}")
        return list(stacked.numpy())

    @property
    def collective_weight_reads(self) -> bool:  # MeshRuntime
        """Whether reading a weight globally is a collective (some layout rule splits)."""
        if self.extended.keras_layouts is not None:
            return self.mesh.size > 1  # a LayoutMap may split any weight
        return not self.mesh.splits_only_batch

    def __repr__(self):
        return (f"HorovodStrategy(mesh_shape={self.mesh.shape.to_string()!r}, "
                f"layout={self.mesh.rules.to_string()!r})")

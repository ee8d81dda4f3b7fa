"""HorovodStrategy: data parallelism over Horovod ranks for an unmodified Keras 3 `fit`."""

from typing import Optional

import tensorflow as tf

from tfdist.internal.horovod_extended import HorovodExtended

_COMPRESSIONS = ("none", "fp16")


class HorovodStrategy(tf.distribute.Strategy):
    """One replica per Horovod process; gradients by Horovod's ring all-reduce.

    Launch with `horovodrun -np N --gloo -H localhost:N python script.py`
    (`-H host1:8,host2:8` on a cluster). Initial weights come from rank 0,
    each rank trains on its slice of every global batch, gradients are summed
    with `hvd.grouped_allreduce` (optionally fp16-compressed), metric results
    read after a step or by `evaluate` are global and identical on every rank.
    Write checkpoints and logs where `strategy.rank == 0`
    (`tfdist.callbacks.is_chief`).

    Args:
        compression: "none" or "fp16" (gradients travel as float16).
        reduction: "sum" (ring all-reduce) or "adasum" (Horovod's Adasum;
            needs a Horovod built with MPI, else a clear error).
        device: this process's device (default: GPU `local_rank` if there are
            GPUs, else the CPU).
    """

    _collective_key_base = 90000  # read by MirroredExtended; TF's own collectives are unused

    def __init__(self, compression: str = "none", device: Optional[str] = None,
                 reduction: str = "sum"):
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
        hvd.init()
        if device is None:
            gpus = tf.config.list_logical_devices("GPU")
            device = gpus[hvd.local_rank() % len(gpus)].name if gpus else "/cpu:0"
        codec = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
        super().__init__(HorovodExtended(self, hvd, device, codec, adasum=reduction == "adasum"))
        self.hvd = hvd

    @property
    def rank(self) -> int:
        return self.hvd.rank()

    @property
    def size(self) -> int:
        return self.hvd.size()

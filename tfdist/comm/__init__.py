"""Communication backends: one interface (`Backend`), its implementations side by side.

- `TFCollectiveBackend`: TensorFlow collective ops (`tfdist.comm.tf_collectives`).
- `HorovodBackend`: Horovod over process sets (`tfdist.comm.horovod`; imported
  on first use, so Horovod is needed only by `HorovodStrategy`).
"""

from tfdist.comm.base import Backend, Group
from tfdist.comm.tf_collectives import TFCollectiveBackend

__all__ = ["Backend", "Group", "HorovodBackend", "TFCollectiveBackend"]


def __getattr__(name):
    if name == "HorovodBackend":
        from tfdist.comm.horovod import HorovodBackend

        return HorovodBackend
    raise AttributeError(f"module 'tfdist.comm' has no attribute {name!r}")

"""One function turns a strategy name into a strategy."""

import tensorflow as tf

from tfdist.mesh import Mesh
from tfdist.strategies.averaging import ModelAveragingStrategy
from tfdist.strategies.mesh_strategy import MeshStrategy
from tfdist.strategies.multi_worker import MultiWorkerStrategy


def _default(**options):
    _no_options("default", options)
    return tf.distribute.get_strategy()


def _one_device(device="/cpu:0", **options):
    _no_options("one_device", options)
    return tf.distribute.OneDeviceStrategy(device)


def _mirrored(devices=None, **options):
    _no_options("mirrored", options)
    return tf.distribute.MirroredStrategy(devices)


def _mesh(mesh_shape="data:1", layout=None, devices=None, **options):
    return MeshStrategy(mesh_shape, layout, devices=devices, **options)


def _mesh_cluster(mesh_shape="data:1", layout=None, devices_per_worker=None, **options):
    """A mesh over the tasks of TF_CONFIG (single controller; serves and exits elsewhere)."""
    from tfdist.cluster import ClusterConfig

    cluster = ClusterConfig.from_env()
    if cluster is None:
        raise ValueError("Strategy 'mesh_cluster' needs TF_CONFIG (python -m tfdist.launch sets it).")
    mesh = Mesh.parse(mesh_shape, layout)
    return MeshStrategy(mesh, devices=cluster.mesh_devices(mesh.size, devices_per_worker),
                        **options)


def _multi_worker(**options):
    return MultiWorkerStrategy(**options)


def horovod_strategy_class():
    """Imports and returns `HorovodStrategy`, or says how to build Horovod.

    Imports `horovod.tensorflow` first, so a missing (or broken) Horovod build
    fails here with one message, not deep inside the strategy.

    Raises:
        ImportError: `import horovod.tensorflow` fails; the message says to run
            `make horovod` (or `scripts/install_horovod.sh`).
    """
    try:
        import horovod.tensorflow  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"HorovodStrategy needs Horovod built against this TensorFlow, but "
            f"`import horovod.tensorflow` failed ({e}). Build it with `make horovod` "
            f"(or `scripts/install_horovod.sh [PYTHON]`).") from e
    from tfdist.strategies.horovod import HorovodStrategy

    return HorovodStrategy


def _horovod(**options):
    return horovod_strategy_class()(**options)


def _tpu(**options):
    from tfdist.launch.tpu import tpu_strategy

    return tpu_strategy(**options)


def _averaging(**options):
    return ModelAveragingStrategy(**options)


def _no_options(name, options):
    if options:
        raise ValueError(f"Strategy {name!r} takes no options {sorted(options)}.")


_FACTORIES = {
    "default": _default,
    "one_device": _one_device,
    "mirrored": _mirrored,
    "mesh": _mesh,
    "mesh_cluster": _mesh_cluster,
    "multi_worker": _multi_worker,
    "averaging": _averaging,
    "horovod": _horovod,
    "tpu": _tpu,
}

STRATEGY_NAMES = tuple(_FACTORIES)


def get_strategy(name: str, **options):
    """Returns the strategy called `name`, built with `options`.

    Args:
        name: one of `STRATEGY_NAMES` (`default`, `one_device`, `mirrored`,
            `mesh`, `mesh_cluster`, `multi_worker`, `averaging`, `horovod`, `tpu`).
        **options: keyword arguments of that strategy, e.g.
            `mesh_shape="data:2;model:2", layout="d_ff:model"` for `mesh`.

    Raises:
        ValueError: for an unknown name, listing the valid ones.
    """
    if name not in _FACTORIES:
        raise ValueError(
            f"Unknown strategy {name!r}: valid strategies are {list(STRATEGY_NAMES)}."
        )
    return _FACTORIES[name](**options)

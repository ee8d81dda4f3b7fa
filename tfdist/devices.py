"""Virtual devices: one CPU split into several logical devices.

For a mesh on a laptop, in tests and in demos: `tfdist.split_cpu(4)` before
TensorFlow starts gives four CPU devices a strategy can place replicas on
(they share the machine's cores).
"""

import tensorflow as tf


def split_cpu(num_devices: int = 8) -> None:
    """Splits the first physical CPU into `num_devices` logical devices.

    Must run before TensorFlow initialises its devices (before any op runs).

    Raises:
        RuntimeError: TensorFlow has already initialised a different split.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == num_devices:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices
        )
    except RuntimeError as e:
        have = len(tf.config.list_logical_devices("CPU"))
        if have >= num_devices:
            return
        raise RuntimeError(
            f"Cannot split the CPU into {num_devices} devices: TensorFlow has "
            f"already initialised {have}. Call tfdist.split_cpu before any TF op runs."
        ) from e

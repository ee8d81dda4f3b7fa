"""tfdist: Keras 3 / TensorFlow distribution toolkit (meshes, sharded layers, strategies)."""

__version__ = "0.1.0"

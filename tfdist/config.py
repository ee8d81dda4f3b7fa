"""Frozen configurations, validated before anything is built.

Flags (defined only in `scripts/`) become one of these; `validate()` raises a
single clear `ValueError` naming the bad value, before TensorFlow starts.
"""

import dataclasses
import os

from tfdist.mesh import Mesh


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Where a model runs.

    Args:
        mesh_shape: Mesh-TF mesh shape, e.g. `"data:2;model:2"`.
        layout: Mesh-TF layout rules, e.g. `"batch:data;d_ff:model"`.
    """

    mesh_shape: str = "data:1"
    layout: str = ""

    def validate(self) -> "MeshConfig":
        self.mesh()
        return self

    def mesh(self) -> Mesh:
        return Mesh.parse(self.mesh_shape, self.layout)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run of the demo model.

    Args:
        mesh: the `MeshConfig`.
        steps: optimizer steps.
        batch_size: global batch size; must divide by the number of devices.
        learning_rate: Adam learning rate.
        vocab_size, d_model, d_ff, length: model sizes.
        seed: seed of the data and the initial weights.
    """

    mesh: MeshConfig = MeshConfig()
    steps: int = 200
    batch_size: int = 32
    learning_rate: float = 3e-3
    vocab_size: int = 64
    d_model: int = 32
    d_ff: int = 128
    length: int = 8
    seed: int = 0

    def validate(self) -> "TrainConfig":
        mesh = self.mesh.mesh()
        for name in ("steps", "batch_size", "vocab_size", "d_model", "d_ff", "length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer; received {name}={value!r}.")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be positive; received {self.learning_rate!r}.")
        if self.batch_size % mesh.size:
            raise ValueError(
                f"batch_size={self.batch_size} does not divide by the {mesh.size} "
                f"devices of mesh {mesh.shape}; use a multiple of {mesh.size}."
            )
        for name, logical in (("vocab_size", "vocab"), ("d_model", "d_model"), ("d_ff", "d_ff")):
            axis = mesh.mesh_axis(logical)
            size = mesh.axis_size(axis)
            if getattr(self, name) % size:
                raise ValueError(
                    f"{name}={getattr(self, name)} does not divide by mesh axis "
                    f"{axis!r} of size {size} (layout rule '{logical}:{axis}')."
                )
        return self


@dataclasses.dataclass(frozen=True)
class XCConfig:
    """An extreme-classification run (scripts/train_xc.py).

    Args:
        mesh: where it runs; the rule for `classes` splits the head.
        num_classes: C.
        d_model: feature size (synthetic data) or hidden size (files).
        batch_size: global batch; must divide by the number of devices.
        steps: optimizer steps.
        learning_rate: Adam learning rate.
        label_smoothing: epsilon over the global C.
        sample_rate: class-centre sampling for training (Partial FC); 1.0 = all classes.
        train_file, test_file: XMC/libsvm files; synthetic data when unset.
        eval_examples: held-out examples for top-1/top-5.
        seed: data and initial weights.
    """

    mesh: MeshConfig = MeshConfig("data:1;model:2", "batch:data;classes:model")
    num_classes: int = 1_000_000
    d_model: int = 256
    batch_size: int = 256
    steps: int = 100
    learning_rate: float = 1e-2
    label_smoothing: float = 0.0
    sample_rate: float = 1.0
    train_file: str = ""
    test_file: str = ""
    eval_examples: int = 2048
    seed: int = 0

    def validate(self) -> "XCConfig":
        mesh = self.mesh.mesh()
        for name in ("num_classes", "d_model", "batch_size", "steps", "eval_examples"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer; received {name}={value!r}.")
        if self.batch_size % mesh.size:
            raise ValueError(
                f"batch_size={self.batch_size} does not divide by the {mesh.size} "
                f"devices of mesh {mesh.shape}; use a multiple of {mesh.size}."
            )
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1); received {self.label_smoothing!r}.")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1]; received {self.sample_rate!r}.")
        for name in ("train_file", "test_file"):
            path = getattr(self, name)
            if path and not os.path.exists(path):
                raise ValueError(f"{name}={path!r} does not exist.")
        if bool(self.train_file) != bool(self.test_file):
            raise ValueError("Give both train_file and test_file, or neither (synthetic data).")
        return self

"""Frozen configurations, validated before anything is built.

Flags (defined only in `scripts/`) become one of these; `validate()` raises a
single clear `ValueError` naming the bad value, before TensorFlow starts.
"""

import dataclasses

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

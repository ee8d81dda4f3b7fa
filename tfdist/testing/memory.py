"""What one device holds: bytes of a model's weights and optimizer variables."""


def device_bytes(model, device_index: int = 0) -> int:
    """Bytes of the components of `model`'s weights and optimizer variables on one device.

    A sharded weight counts its shard; a replicated one its full copy.
    """
    variables = list(model.weights)
    if getattr(model, "optimizer", None) is not None:
        variables += list(model.optimizer.variables)
    total = 0
    for v in variables:
        components = getattr(v.value, "values", (v.value,))
        component = components[min(device_index, len(components) - 1)]
        total += component.shape.num_elements() * component.dtype.size
    return total

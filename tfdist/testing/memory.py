"""What one device holds: bytes of a model's weights and optimizer variables."""


def device_bytes(model, device_index: int = 0) -> int:
    """Bytes of the components of `model`'s weights and optimizer variables on one device.

    A sharded weight counts its shard; a replicated one its full copy; a
    weight ZeRO-1/2 splits counts its shard and its kept whole copy.
    """
    variables = [v.value for v in model.weights]
    if getattr(model, "optimizer", None) is not None:
        variables += [v.value for v in model.optimizer.variables]
    variables += [v._tfdist_kept.copy for v in variables
                  if getattr(v, "_tfdist_kept", None) is not None]
    total = 0
    for v in variables:
        components = getattr(v, "values", (v,))
        component = components[min(device_index, len(components) - 1)]
        total += component.shape.num_elements() * component.dtype.size
    return total


def job_status(field: str) -> dict:
    """`{task index: bytes}` of `/proc/PID/status` entry `field` (`VmHWM`, `VmPeak`) for every
    process running this process's command line (the tasks of a `tfdist.launch` job; the
    task index from each one's TF_CONFIG, 0 without one)."""
    import json
    import os

    me = open(f"/proc/{os.getpid()}/cmdline", "rb").read()
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{pid}/cmdline", "rb").read() != me:
                continue
            task = 0
            for entry in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                if entry.startswith(b"TF_CONFIG="):
                    task = json.loads(entry[len(b"TF_CONFIG="):])["task"]["index"]
            for line in open(f"/proc/{pid}/status"):
                if line.startswith(field + ":"):
                    out[task] = int(line.split()[1]) * 1024
        except OSError:
            continue
    return out


def optimizer_bytes(model, device_index: int = 0) -> int:
    """Bytes of the components of `model.optimizer`'s variables on one device (slots, counters)."""
    total = 0
    for v in model.optimizer.variables:
        components = getattr(v.value, "values", (v.value,))
        component = components[min(device_index, len(components) - 1)]
        total += component.shape.num_elements() * component.dtype.size
    return total


# Environment for a subprocess whose RSS should follow its live tensors: with
# oneDNN on, TF's CPU allocator keeps freed tensors in its pool, and glibc keeps
# large freed blocks once its dynamic mmap threshold has grown (to 32 MiB).
RSS_FOLLOWS_TENSORS = {"TF_ENABLE_ONEDNN_OPTS": "0", "MALLOC_MMAP_THRESHOLD_": "65536"}


def status_mib(field: str) -> float:
    """This process's `/proc/self/status` entry `field` (`VmRSS`, `VmHWM`) in MiB."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak_rss() -> float:
    """Resets the peak RSS (`VmHWM`) to the current RSS and returns that RSS in MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_mib("VmRSS")

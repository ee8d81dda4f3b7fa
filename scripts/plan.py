"""Prints the planner's ranked layouts for train_nmt.py's model, and the flags to train it.

Takes train_nmt.py's flags, so the command line that plans is the one that trains:

    python scripts/plan.py --mesh_shape='data:4' --d_model=512 --d_ff=2048 \
        --moe_experts=8 --max_tokens=4096 --max_length=64 --memory_per_device=1GiB

For the devices of --mesh_shape (its size; its axes do not matter), every
`data x model` layout tfdist can run is weighed: bytes per device (weights and
Adam's slots exact, gradients, activations estimated) and the predicted step
time from this machine's calibration (measured once, a few seconds per device
count, cached in ~/.cache/tfdist/planner). The fastest that fits is printed as
flags; `train_nmt.py --layout=auto` takes it directly. Nothing fitting exits
with one line naming the least memory per device that would do.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402

from flag_utils import run  # noqa: E402
import train_nmt  # noqa: E402


def main(argv):
    del argv
    try:
        ranked = train_nmt.plan_from_flags()
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    print(ranked.table())
    if ranked.invalid:
        print(f"({len(ranked.invalid)} layouts left out: a dimension does not divide or two "
              f"dimensions of a weight share a mesh axis)")
    print(f"\nbest: {ranked.best.flags}")
    return 0


if __name__ == "__main__":
    train_nmt.define_flags()
    run(main)

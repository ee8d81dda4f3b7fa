"""tfdist.core.routing: the groups each gradient is summed over, from layouts alone (no TF run).

The reference is written out by hand from the mesh's device numbering (row-major:
on data:2;model:2, device = 2 * data + model), sharing no code with the plan.
"""

import dataclasses

import pytest

from tfdist.core import routing
from tfdist.mesh import Mesh


@dataclasses.dataclass
class _Var:  # what the plan reads of a variable: its layout (None: replicated)
    layout: object = None


def _sharded(mesh, axes, shape=(4, 8)):
    return _Var(Mesh.parse(mesh, "d_ff:model;batch:data").tensor_layout(axes, shape))


def test_replicated_weights_sum_over_everyone_last_layer_first():
    plan = routing.plan_reduction([_Var(), _Var(), _Var()], ["dense"] * 3, [0, 1, 2, 3], 4)
    assert plan.dense == ({(0, 1, 2, 3): [2, 1, 0]},) * 4
    assert plan.sparse == ({},) * 4 and plan.as_is == ()


def test_a_shard_sums_over_its_owners_only():
    kernel = _sharded("data:2;model:2", ("d_model", "d_ff"))  # split over model
    plan = routing.plan_reduction([_Var(), kernel], ["dense", "dense"], [0, 1, 2, 3], 4)
    # model=0 lives on devices 0 and 2, model=1 on 1 and 3.
    assert plan.dense[0] == {(0, 1, 2, 3): [0], (0, 2): [1]}
    assert plan.dense[1] == {(0, 1, 2, 3): [0], (1, 3): [1]}
    assert plan.dense[2] == {(0, 1, 2, 3): [0], (0, 2): [1]}
    assert plan.dense[3] == {(0, 1, 2, 3): [0], (1, 3): [1]}


def test_sparse_and_already_global_gradients():
    table = _sharded("data:1;model:2", ("d_ff", "d_model"))
    plan = routing.plan_reduction([_Var(), table, _Var()], ["sparse", "sparse", "as_is"],
                                  [0, 1], 2)
    assert plan.sparse == ({0: (0, 1), 1: (0,)}, {0: (0, 1), 1: (1,)})
    assert plan.as_is == (2,) and plan.dense == ({}, {})


def test_a_process_plans_for_its_own_replicas_only():
    # A Horovod rank (one local replica) holding mesh device 3 of data:2;model:2.
    kernel = _sharded("data:2;model:2", ("d_model", "d_ff"))
    plan = routing.plan_reduction([kernel], ["dense"], [3], 4)
    assert plan.dense == ({(1, 3): [0]},)


def test_bad_kinds_are_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        routing.plan_reduction([_Var()], ["summed"], [0], 1)
    with pytest.raises(ValueError, match="one kind per variable"):
        routing.plan_reduction([_Var()], [], [0], 1)

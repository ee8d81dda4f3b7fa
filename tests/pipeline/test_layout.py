"""The stage axis in the layout language: checked before any graph exists (pure Python)."""

import pytest

from tfdist.mesh import LayoutRules
from tfdist.pipeline.layout import PipelinePlan


def test_layers_split_over_the_stage_axis_and_the_batch_over_data():
    plan = PipelinePlan.from_mesh("stage:2;data:2;model:1", "layers:stage;batch:data;d_ff:model",
                                  num_layers=8, num_microbatches=3, global_batch=6)
    assert (plan.stage_axis, plan.data_axis, plan.num_stages, plan.num_replicas) == (
        "stage", "data", 2, 2)
    assert [plan.layers_of(k) for k in range(2)] == [range(0, 4), range(4, 8)]
    # Row-major mesh: device i at (stage=i // 2, data=i % 2).
    assert [plan.stage_devices(s) for s in range(2)] == [(0, 1), (2, 3)]
    assert plan.schedule().name == "1f1b"
    # The stage axis inside: device i at (data=i // 2, stage=i % 2).
    inner = PipelinePlan.from_mesh("data:2;stage:2", "batch:data;layers:stage", 4, 1)
    assert [inner.stage_devices(s) for s in range(2)] == [(0, 2), (1, 3)]
    # Interleaved: 2 chunks per device, 4 virtual stages of 3 layers.
    chunks = PipelinePlan.from_mesh("stage:2", "layers:stage", 12, 4, "interleaved_1f1b", 2)
    assert [chunks.layers_of(k) for k in range(4)] == [range(0, 3), range(3, 6), range(6, 9),
                                                       range(9, 12)]
    assert chunks.num_replicas == 1 and chunks.stage_devices(1) == (1,)
    assert LayoutRules.parse("layers:stage").mesh_axis("layers") == "stage"


@pytest.mark.parametrize("args,kwargs,message", [
    (("stage:2", "batch:stage", 8, 2), {},
     r"Layout 'batch:stage' has no rule for the logical axis 'layers': add e.g. 'layers:stage'"),
    (("stage:4", "layers:stage", 6, 2), {},
     r"num_layers=6 does not split over mesh axis stage:4: give a multiple of 4 layers, or a "
     r"'stage' axis of size in \[1, 2, 3, 6\]"),
    (("stage:2", "layers:stage", 6, 4, "interleaved_1f1b", 2), {},
     r"num_layers=6 does not split over mesh axis stage:2 x 2 chunks: give a multiple of 4 "
     r"layers, or a 'stage' axis of size in \[1, 3\]"),
    (("stage:2", "layers:stage", 8, 0), {}, r"num_microbatches=0: must be an integer >= 1"),
    (("stage:2", "layers:stage", 8, 2, "pipedream"), {},
     r"schedule='pipedream': valid schedules are \['gpipe', '1f1b', 'interleaved_1f1b'\]"),
    (("stage:2", "layers:stage", 8, 2, "1f1b", 2), {},
     r"num_chunks=2: schedule '1f1b' has one chunk per device"),
    (("stage:2;data:2", "layers:stage;batch:data", 8, 4), {"global_batch": 6},
     r"global_batch=6 gives fewer rows than micro-batches: 2 data replica\(s\) x "
     r"num_microbatches=4 need at least 8 rows; lower num_microbatches to at most 3"),
    (("stage:2;model:2", "layers:stage;d_ff:model", 8, 2), {},
     r"Mesh stage:2;model:2 has axes \['model'\] besides the stage axis 'stage'"),
    (("stage:2", "layers:stage;batch:stage", 8, 2), {},
     r"maps both 'layers' and 'batch' to 'stage'"),
    (("stage:2", "layers:pipe", 8, 2), {},
     r"Layout rule 'layers:pipe' .* points at mesh axis 'pipe', but mesh stage:2 has axes"),
])
def test_a_bad_pipeline_layout_is_one_clear_error(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelinePlan.from_mesh(*args, **kwargs)

"""Plan: a typed config that maps one to one onto TOML/JSON and rejects impossible plans before any work."""

from __future__ import annotations

import json

import pytest
from torch import nn

from hpdl.models.gpt import GPT, GPTConfig
from hpdl.parallel import Mesh, Plan, build
from hpdl.parallel.mesh.plan_config import PlanError


def test_round_trip_through_toml_and_json(tmp_path):
    plan = Plan(
        dp=-1,
        pp=2,
        tp=2,
        zero_stage=2,
        micro_batches=4,
        schedule="gpipe",
        recompute="except_last",
        bucket_mb=8,
        mixed_precision="bf16",
        tp_plan={"*.fc": "column", "*.proj": "row"},
        balance=[2, 3],
        placement=("dp", "tp", "pp"),
    )
    for name in ("plan.toml", "plan.json"):
        path = plan.to_file(str(tmp_path / name))
        assert Plan.from_file(path) == plan
    assert Plan.from_file(Plan().to_file(str(tmp_path / "default.toml"))) == Plan()
    (tmp_path / "hand.toml").write_text('dp = 2\ntp = 2\n[tp_plan]\n"*.fc" = "column"\n')
    assert Plan.from_file(str(tmp_path / "hand.toml")) == Plan(dp=2, tp=2, tp_plan={"*.fc": "column"})


def test_unknown_keys_are_named_with_the_valid_ones(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"dp": 2, "zero": 2, "microbatches": 4}))
    with pytest.raises(PlanError) as err:
        Plan.from_file(str(path))
    assert "'zero', 'microbatches'" in str(
        err.value
    ) and "valid keys: dp, pp, tp, sp, spatial_dim, spatial_grid, spatial_stages, zero_stage" in str(err.value)
    (tmp_path / "bad.toml").write_text("dp = [")
    with pytest.raises(PlanError, match="not valid TOML"):
        Plan.from_file(str(tmp_path / "bad.toml"))
    with pytest.raises(PlanError, match=r"must end in \.toml or \.json"):
        Plan().to_file(str(tmp_path / "plan.yaml"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dp": 0}, r"dp=0 must be a positive int, or -1"),
        ({"dp": -1, "tp": -1}, r"at most one degree may be -1"),
        ({"zero_stage": 4}, r"zero_stage=4 must be one of \[0, 1, 2, 3\]"),
        ({"schedule": "gpipe"}, r"schedule='gpipe' needs pipeline stages \(pp > 1\); pp is 1"),
        ({"schedule": "zigzag", "pp": 2}, r"schedule='zigzag' must be one of"),
        ({"micro_batches": 4}, r"micro_batches=4 needs pipeline stages.*no_sync"),
        ({"recompute": "always"}, r"recompute='always' applies to pipeline stages"),
        ({"mixed_precision": "bf16"}, r"keeps fp32 master copies in the ZeRO optimizer"),
        ({"zero_stage": 2, "reshard_after_forward": False}, r"reshard_after_forward=false keeps ZeRO-3's"),
        ({"compression": "fp16", "zero_stage": 2}, r"compression='fp16' applies to DataParallel"),
        ({"compression": "int8"}, r"compression='int8' must be one of"),
        ({"tp_plan": {"*.fc": "diagonal"}}, r"tp_plan\['\*.fc'\] = 'diagonal'"),
        ({"placement": ("tp", "dp")}, r"placement=\['tp', 'dp'\] must order the axes"),
        ({"bucket_mb": 0}, r"bucket_mb=0 must be a positive number"),
        ({"pp": 2, "balance": [1, 1, 1]}, r"balance=\[1, 1, 1\] lists 3 stages but pp=2"),
        ({"sp": 2, "tp": 2}, r"sp=2 \(spatial\) combines with dp and pp only; got tp=2.*'filter'/'channel'"),
        ({"sp": 2, "zero_stage": 1}, r"combines with dp and pp only; got zero_stage=1"),
        ({"sp": 2, "pp": 2, "micro_batches": 2, "spatial_stages": 3}, r"spatial_stages=3 must be 1..pp \(2\)"),
        ({"sp": -1, "dp": -1}, r"at most one degree may be -1"),
        ({"spatial_dim": 1}, r"spatial_dim=1 must be 2 or more"),
        ({"sp": 4, "spatial_dim": [2, 3], "spatial_grid": [2, 3]}, r"dim 2\(2\) \* dim 3\(3\) = 6 != the group's 4"),
        ({"sp": 2, "spatial_grid": [2]}, r"spatial_grid=\[2\] needs a list spatial_dim"),
    ],
)
def test_impossible_fields_are_rejected_with_the_reason(fields, message):
    with pytest.raises(PlanError, match=message):
        Plan(**fields)


def test_spatial_degree_round_trips_and_old_placements_gain_it(tmp_path):
    plan = Plan(dp=2, sp=-1, spatial_dim=3)
    for name in ("plan.toml", "plan.json"):
        assert Plan.from_file(plan.to_file(str(tmp_path / name))) == plan
    assert plan.validate(8).degrees() == {"dp": 2, "pp": 1, "tp": 1, "sp": 4}
    assert "spatial   each sample split in 4 slabs along dim 3" in plan.validate(8).describe()
    (tmp_path / "old.toml").write_text('dp = 2\nplacement = ["dp", "tp", "pp"]\n')  # written before sp existed
    assert Plan.from_file(str(tmp_path / "old.toml")).placement == ("dp", "tp", "sp", "pp")
    with pytest.raises(PlanError, match=r"dp\(2\) \* pp\(1\) \* tp\(1\) \* sp\(3\) != world size 8"):
        Plan(dp=2, sp=3).validate(8)


def test_validate_infers_and_checks_against_the_world_and_the_model():
    assert Plan(dp=-1, pp=2, tp=2, micro_batches=2).validate(8).degrees() == {"dp": 2, "pp": 2, "tp": 2, "sp": 1}
    with pytest.raises(PlanError, match=r"dp\(2\) \* pp\(2\) \* tp\(3\) != world size 8"):
        Plan(dp=2, pp=2, tp=3).validate(8)
    with pytest.raises(
        PlanError, match=r"pp = -1 cannot be inferred: dp\(3\) \* tp\(1\) = 3 does not divide world size 8"
    ):
        Plan(dp=3, pp=-1).validate(8)
    with pytest.raises(PlanError, match=r"'1f1b' needs micro_batches >= pp; micro_batches=2, pp=4"):
        Plan(dp=1, pp=4, micro_batches=2).validate(4)
    assert Plan(dp=1, pp=4, micro_batches=2, schedule="gpipe").validate(4).pipeline_schedule == "gpipe"
    gpt = GPT(GPTConfig(vocab_size=30, n_head=6, n_embd=48, n_layer=1))
    with pytest.raises(PlanError, match=r"tp=4 cannot split embed.tok \(vocab\): the vocabulary \(30\)"):
        Plan(dp=1, tp=4).validate(4, gpt)
    with pytest.raises(PlanError, match=r"tp=4 must divide the number of attention heads \(6\)"):
        Plan(dp=1, tp=4, tp_plan={"*.attn.qkv": "qkv"}).validate(4, gpt)
    with pytest.raises(PlanError, match=r"tp=5 cannot split block0.attn.qkv \(qkv\): hidden \(48\) does not divide"):
        Plan(dp=1, tp=5, tp_plan={"*.attn.qkv": "qkv"}).validate(5, gpt)
    with pytest.raises(PlanError, match=r"pattern '\*.nothing' \(row\) matches no module"):
        Plan(dp=1, tp=2, tp_plan={"*.nothing": "row"}).validate(2, gpt)
    with pytest.raises(PlanError, match=r"pp=4 stages but the model has only 3 layers"):
        Plan(dp=1, pp=4, micro_batches=4).validate(4, gpt)
    with pytest.raises(PlanError, match=r"is not one. Express the model as an nn.Sequential"):
        Plan(dp=1, pp=2, micro_batches=2).validate(2, nn.ModuleList([nn.Linear(2, 2)]))
    with pytest.raises(PlanError, match=r"no tp_plan names layers to split"):
        Plan(dp=1, tp=2).validate(2, nn.Sequential(nn.Linear(4, 4)))
    assert Plan(dp=1, tp=2).validate(2, GPT(GPTConfig(vocab_size=32))).tp == 2


def test_mesh_errors_print_every_factor(ranks):
    comm = ranks("self").comm
    with pytest.raises(ValueError, match=r"dp\(1\) \* pp\(2\) \* tp\(1\) != world size 1"):
        Mesh(comm, dp=1, pp=2)
    with pytest.raises(ValueError, match=r"placement"):
        Mesh(comm, placement=("dp", "pp"))
    mesh = Mesh(comm)
    assert mesh.shape == {"dp": 1, "pp": 1, "tp": 1, "sp": 1} and "rank 0: tp=0 sp=0 dp=0 pp=0" in mesh.describe()
    gpt = GPT(GPTConfig(vocab_size=32))
    with pytest.raises(PlanError, match=r"dp\(1\) \* pp\(1\) \* tp\(2\) != world size 1"):
        build(gpt, mesh, Plan(dp=1, tp=2))
    with pytest.raises(PlanError, match=r"the plan places the axes \['dp', 'tp', 'sp', 'pp'\] but the mesh"):
        build(gpt, mesh, Plan(dp=1, placement=("dp", "tp", "pp")))


def test_describe_names_every_setting():
    text = Plan(dp=2, pp=2, micro_batches=4, zero_stage=1, tp_plan={"*.fc": "column"}, tp=1).describe()
    assert "dp=2 x pp=2 x tp=1" in text and "stage 1" in text and "1f1b, 4 micro-batches" in text


def test_group_members_say_which_groups_cross_a_node():
    """dp3 x tp2 x pp2 on 12 ranks placed (dp, tp, pp), 4 ranks a node: tp groups {1, 4}, {2, 5}, {6, 9}, {7, 10}
    cross a node boundary although a tp group (2) fits in a node; placed (tp, ...) none does."""
    from hpdl.parallel.mesh.mesh import crossing_groups, group_members

    shape = {"dp": 3, "pp": 2, "tp": 2, "sp": 1}
    spread = ("dp", "tp", "sp", "pp")
    assert group_members(shape, spread, {"dp": 1, "pp": 0, "tp": 0, "sp": 0}, "tp") == [1, 4]
    assert sorted(crossing_groups(shape, spread, "tp", 4)) == [[1, 4], [2, 5], [6, 9], [7, 10]]
    assert crossing_groups(shape, ("tp", "sp", "dp", "pp"), "tp", 4) == []
    assert crossing_groups(shape, spread, "sp", 4) == []  # sp = 1: no group to cross
    assert crossing_groups({"dp": 1, "pp": 1, "tp": 1, "sp": 8}, ("tp", "sp", "dp", "pp"), "sp", 4) == [list(range(8))]

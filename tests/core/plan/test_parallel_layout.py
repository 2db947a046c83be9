"""The rank layout's arithmetic, pinned: the engine's config (`parallel_sizes`) and the planner's
--tp/--ep (`make_mesh`) build the same torch-free type (plan.parallel.ParallelSizes) with the
same dp, dp_shard and efsdp for each world size."""
import pytest

from config_schemas.validate import ConfigError
from vescale_engine.engine.config import ParallelSizes as EngineSizes, parallel_sizes
from vescale_engine.plan.parallel import ParallelSizes, make_mesh

# (world, tp, ep, replicate) -> (dp, dp_shard, efsdp)
CASES = [
    ((8, 1, 1, 1), (8, 8, 8)),
    ((8, 2, 1, 1), (4, 4, 8)),    # efsdp: no expert units with ep 1, the engine builds no mesh
    ((4, 4, 1, 1), (1, 1, 4)),
    ((8, 1, 2, 1), (8, 8, 4)),
    ((16, 1, 4, 2), (16, 8, 2)),
    ((16, 2, 1, 2), (8, 4, 8)),
    ((64, 1, 8, 1), (64, 64, 8)),
]


def engine_config(tp, ep, replicate):
    return {"tensor_parallel": {"autotp_size": tp},
            "expert_parallel": {"enabled": ep > 1, "autoep_size": ep},
            "vescale": {"hsdp_replicate_size": replicate}}


def test_one_type():
    assert EngineSizes is ParallelSizes


@pytest.mark.parametrize("sizes,expected", CASES)
def test_engine_and_planner_agree(sizes, expected):
    world, tp, ep, replicate = sizes
    engine = parallel_sizes(engine_config(tp, ep, replicate), world)
    planner = make_mesh(world, tp, ep, replicate)
    assert engine == planner == ParallelSizes(world, tp, ep, replicate)
    for layout in (engine, planner):
        assert (layout.tp, layout.ep) == (tp, ep)
        assert (layout.dp, layout.dp_shard, layout.efsdp) == expected
        assert layout.shard == layout.dp_shard
        assert layout.replicate * layout.dp_shard * layout.tp == world
        if ep > 1:  # the expert mesh (replicate, efsdp, ep) covers the world
            assert layout.replicate * layout.efsdp * layout.ep == world


def test_tp_with_ep_is_the_planners_alone():
    """The planner lays TP and EP together as transformers and torchtitan do (experts not
    TP-split, efsdp = dp_shard x tp / ep); the engine refuses the combination."""
    mesh = make_mesh(16, 2, 4)
    assert (mesh.dp, mesh.dp_shard, mesh.efsdp) == (8, 8, 4)
    with pytest.raises(ConfigError, match="tensor and expert parallelism together"):
        parallel_sizes(engine_config(2, 4, 1), 16)


def test_stage_0_replicates_every_data_parallel_rank():
    config = {**engine_config(2, 1, 1), "zero_optimization": {"stage": 0}}
    sizes = parallel_sizes(config, 8)
    assert sizes == ParallelSizes(8, tp=2, replicate=4) and sizes.dp_shard == 1

"""The engine's extension points (engine/extensions.py): what DeepSpeed and transformers add to
`initialize` arrives through `integrations.connect()`, which patches nothing; a role nobody fills
is a one-line error naming what needed it; an unset key's default is the integration's."""
import pytest

import vescale_engine
from vescale_engine.engine import extensions
from vescale_engine.engine.config import build_config


def test_connect_registers_each_integrations_roles_and_patches_nothing():
    from vescale_engine.integrations import installed
    before = installed()
    vescale_engine._connect()
    vescale_engine._connect()  # idempotent
    by_library = {e.library: e for e in extensions.registered()}
    assert set(by_library) == {"deepspeed", "transformers"}
    filled = {role: [e.library for e in extensions.registered(role)]
              for role in ("check_model", "before_wrap", "extra_units", "scheduler_class",
                           "sequence_parallel_loader", "engine_built", "tensor_parallel",
                           "expert_parallel")}
    assert filled == {"check_model": ["deepspeed"], "before_wrap": ["deepspeed"],
                      "extra_units": ["deepspeed"], "scheduler_class": ["deepspeed"],
                      "sequence_parallel_loader": ["deepspeed"],
                      "engine_built": ["deepspeed", "transformers"],
                      "tensor_parallel": ["transformers"], "expert_parallel": ["transformers"]}
    assert installed() == before  # registering is not patching
    assert extensions.first_answer("scheduler_class", "WarmupDecayLR").__module__ == \
        "deepspeed.runtime.lr_schedules"
    assert extensions.first_answer("scheduler_class", "StepLR") is None  # torch's: the engine's


def test_a_role_nobody_fills_is_one_line_naming_what_needed_it(monkeypatch):
    monkeypatch.setattr(extensions, "_REGISTERED", {})
    with pytest.raises(RuntimeError, match=r"^sequence parallelism needs an integration that "
                                           r"fills 'sequence_parallel_loader'"):
        extensions.the_one("sequence_parallel_loader", "sequence parallelism")
    assert extensions.first_answer("extra_units", None, None, None) is None


def test_an_unset_gradient_clipping_means_what_the_deepspeed_integration_says(monkeypatch):
    config = {"train_batch_size": 2}
    assert build_config(config, world_size=1).gradient_clipping == 1.0
    vescale_engine._connect()
    without = {k: v for k, v in extensions._REGISTERED.items() if k != "deepspeed"}
    monkeypatch.setattr(extensions, "_REGISTERED", without)
    assert build_config(config, world_size=1).gradient_clipping == 0.0  # torch's: no clipping

"""Trainer with reentrant gradient checkpointing (LLaMA-Factory's and axolotl's default) against
DeepSpeed ZeRO-3, step by step: test_hf_trainer.py's scripts and checks, in a module of its own
(see LAST_SCENARIOS there for why)."""
import pytest

from test_hf_trainer import LAST_SCENARIOS
from test_hf_trainer import model_dir, pool, runs  # noqa: F401 (the module's fixtures)
from test_hf_trainer import test_trainer_same_steps_as_deepspeed as same_steps_as_deepspeed


@pytest.mark.parametrize("scenario", sorted(LAST_SCENARIOS))
def test_trainer_with_reentrant_checkpointing_same_steps_as_deepspeed(runs, scenario):  # noqa: F811
    same_steps_as_deepspeed(runs, scenario)

"""Checkpoints take a training state, not an engine (checkpoint/state.py): the engine hands its
adapter (engine/training_state.py); any owner of a model, an optimizer and plain values saves
and loads through the same protocol, into the same files. One gloo rank."""
import json
import os

import torch

import fsdp_models as fm
from test_checkpoint import make_engine, train

ENGINE_KEYS = {"format", "tag", "world_size", "global_steps", "global_samples", "micro_steps",
               "skipped_steps", "optimizer", "client_state", "lr_scheduler", "model_keys",
               "files", "state_crc32"}


class Trainer:
    """A training state of a plain model and a torch optimizer, no engine."""

    def __init__(self, module, optimizer, steps=0):
        self.module, self.optimizer, self.steps, self.loaded = module, optimizer, steps, None

    @property
    def step(self):
        return self.steps

    def state_dict(self):
        return {"global_steps": self.steps, "best_loss": torch.tensor([1.5]), "note": "x"}

    def load_state_dict(self, values):
        self.loaded, self.steps = values, values["global_steps"]


def plain_round_trip(rank, world, root):
    from vescale_engine.checkpoint import TrainingState, load_checkpoint, save_checkpoint
    from vescale_engine.fsdp import fully_shard
    model = fully_shard(fm.make("gpt", seed=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    trainer = Trainer(model, optimizer, steps=5)
    assert isinstance(trainer, TrainingState)
    path = save_checkpoint(trainer, root, client_state={"epoch": 2})
    with open(os.path.join(path, "vescale_state.json")) as f:
        keys = set(json.load(f))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = {n: optimizer.state[p]["momentum_buffer"].clone()
                for n, p in model.named_parameters()}

    other = fully_shard(fm.make("gpt", seed=2))
    other_opt = torch.optim.SGD(other.parameters(), lr=0.5, momentum=0.9)
    loaded = Trainer(other, other_opt)
    got, client = load_checkpoint(loaded, root)
    same_weights = all(torch.equal(other.state_dict()[k], v) for k, v in weights.items())
    same_momentum = all(torch.equal(other_opt.state[p]["momentum_buffer"], momentum[n])
                        for n, p in other.named_parameters())
    return (os.path.basename(path), keys, os.path.basename(got), client, loaded.steps,
            sorted(loaded.loaded), loaded.loaded["best_loss"].tolist(), loaded.loaded["note"],
            other_opt.param_groups[0]["lr"], same_weights, same_momentum)


def engine_round_trip(rank, world, root):
    from vescale_engine.checkpoint import TrainingState
    from vescale_engine.engine.training_state import EngineTrainingState
    engine = make_engine(1, "ours")
    assert isinstance(EngineTrainingState(engine), TrainingState)
    train(engine, rank, world, 2)
    path = engine.save_checkpoint(root)
    with open(os.path.join(path, "vescale_state.json")) as f:
        keys = set(json.load(f))
    saved_lr = dict(engine.lr_scheduler.state_dict())
    train(engine, rank, world, 1)
    later_lr = dict(engine.lr_scheduler.state_dict())
    engine.load_checkpoint(root, load_lr_scheduler_states=False)  # the scheduler stays
    kept = dict(engine.lr_scheduler.state_dict())
    engine.load_checkpoint(root)
    return (keys, engine.global_steps, engine.global_samples, engine.micro_steps,
            engine.skipped_steps, saved_lr, later_lr, kept,
            dict(engine.lr_scheduler.state_dict()))




def test_a_training_state_that_is_no_engine(pools, tmp_path):
    (tag, keys, got, client, steps, loaded_keys, best, note, lr, same_weights,
     same_momentum) = pools(1).run(plain_round_trip, str(tmp_path))[0]
    assert tag == got == "global_step5" and client == {"epoch": 2}
    assert {"global_steps", "best_loss", "note", "optimizer", "model_keys"} <= keys
    assert steps == 5 and loaded_keys == ["best_loss", "global_steps", "note"]
    assert best == [1.5] and note == "x" and lr == 0.1
    assert same_weights and same_momentum


def test_the_engines_state_keeps_the_format(pools, tmp_path):
    keys, steps, samples, micro, skipped, saved_lr, later_lr, kept, restored = \
        pools(1).run(engine_round_trip, str(tmp_path))[0]
    assert keys == ENGINE_KEYS
    assert (steps, samples, micro, skipped) == (2, 24, 2, 0)
    assert later_lr != saved_lr and kept == later_lr and restored == saved_lr

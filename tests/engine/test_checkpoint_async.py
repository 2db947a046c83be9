"""Background saves (`"checkpoint": {"writer": {"decoupled": true}}`) on 2 gloo ranks: the same
checkpoint as a synchronous save, bitwise; training runs while the writer writes (an event,
not a sleep); a write failure raised on every rank at the same step, as one line, nothing
published; a second save and destroy() wait for the one in flight; kill -9 during the
background write leaves the previous `latest` loadable."""
import copy
import errno
import os
import signal
import subprocess
import sys
import threading

import torch

from dist_harness import free_port
from test_checkpoint import config as base_config
from test_checkpoint import full_weights, train

# the repository: tests/<tier>/ is two folders down
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = 2
DECOUPLED = {"writer": {"decoupled": True}}


def make_engine(world, decoupled=True):
    import fsdp_models as fm
    from vescale_engine import initialize
    cfg = copy.deepcopy(base_config(world))
    if decoupled:
        cfg["checkpoint"] = copy.deepcopy(DECOUPLED)
    engine, *_ = initialize(model=fm.make("gpt"), config=cfg)
    return engine


class _HeldWriter:
    """sharded._write_checkpoint, held until `release` is set (from the training loop, or a
    timer); records whether training steps ran while it was held."""

    def __init__(self):
        from vescale_engine.checkpoint import sharded
        self.sharded, self.real = sharded, sharded._write_checkpoint
        self.release = threading.Event()
        self.order = []

    def __enter__(self):
        def held(*args, **kwargs):
            self.order.append(("held", args[4]))
            if not self.release.wait(timeout=120):
                raise TimeoutError("the writer was never released")
            self.order.append(("writing", args[4]))
            return self.real(*args, **kwargs)
        self.sharded._write_checkpoint = held
        return self

    def __exit__(self, *exc):
        self.sharded._write_checkpoint = self.real


def save_sync_or_async(rank, world, root, decoupled):
    """Train 2 steps, save, train 2 more; with `decoupled` the writer is held until those 2
    steps ran (it must not stop training). The losses after the save, the saved weights."""
    engine = make_engine(world, decoupled)
    train(engine, rank, world, 2)
    weights = full_weights(engine)
    with _HeldWriter() as writer:
        if not decoupled:
            writer.release.set()
        engine.save_checkpoint(root)
        stall = engine.checkpoint_stall_s
        after = train(engine, rank, world, 2)   # runs while the writer is held
        writer.release.set()
        engine.wait_for_checkpoint()
    with open(os.path.join(root, "latest")) as f:
        latest = f.read().splitlines()[0]
    engine.destroy()
    return {"after": after, "weights": weights if rank == 0 else None, "latest": latest,
            "stall": stall, "order": writer.order}


def load_and_continue(rank, world, root):
    engine = make_engine(world, decoupled=False)
    path, _ = engine.load_checkpoint(root)
    weights = full_weights(engine)
    losses = train(engine, rank, world, 2)
    return {"path": path, "weights": weights if rank == 0 else None, "losses": losses,
            "steps": engine.global_steps}




def test_background_save_equals_a_synchronous_one_and_training_runs_meanwhile(pools, tmp_path):
    sync = pools(WORLD).run(save_sync_or_async, str(tmp_path / "sync"), False)
    back = pools(WORLD).run(save_sync_or_async, str(tmp_path / "async"), True)
    for s, b in zip(sync, back):
        assert b["after"] == s["after"]  # staging changed nothing
        assert b["latest"] == s["latest"] == "global_step2"
    # the writer was held until the 2 steps after the save had run: training went on
    assert [kind for kind, _ in back[0]["order"]] == ["held", "writing"]
    loaded_sync = pools(WORLD).run(load_and_continue, str(tmp_path / "sync"))
    loaded_back = pools(WORLD).run(load_and_continue, str(tmp_path / "async"))
    for name, value in sync[0]["weights"].items():
        assert torch.equal(loaded_back[0]["weights"][name], value), name
        assert torch.equal(loaded_sync[0]["weights"][name], value), name
    for s, b in zip(loaded_sync, loaded_back):
        assert b["losses"] == s["losses"] and b["steps"] == s["steps"] == 4


def failing_background_save(rank, world, root):
    """Rank 1's writer thread finds the disk full: every rank raises at the same step."""
    from vescale_engine.checkpoint import CheckpointWriteError
    engine = make_engine(world)
    train(engine, rank, world, 1)
    engine.save_checkpoint(root)
    engine.wait_for_checkpoint()
    real_fsync = os.fsync

    def full_disk(fd):
        if rank == 1 and threading.current_thread().name == "vescale-checkpoint-writer":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    os.fsync = full_disk
    try:
        engine.save_checkpoint(root)
        for _ in range(500):
            try:
                train(engine, rank, world, 1)
            except CheckpointWriteError as err:
                return {"step": engine.global_steps, "error": str(err),
                        "latest": open(os.path.join(root, "latest")).read().splitlines()[0]}
        return {"step": None}
    finally:
        os.fsync = real_fsync


def test_a_write_failure_is_raised_on_every_rank_at_the_same_step(pools, tmp_path):
    results = pools(WORLD).run(failing_background_save, str(tmp_path / "ckpt"))
    assert results[0]["step"] is not None and results[0]["step"] == results[1]["step"], results
    for r in results:
        assert "\n" not in r["error"] and "No space left" in r["error"], r["error"]
        assert r["latest"] == "global_step1"  # nothing published
    assert not (tmp_path / "ckpt" / "global_step2").exists()


def second_save_and_destroy_wait(rank, world, root):
    engine = make_engine(world)
    train(engine, rank, world, 1)
    with _HeldWriter() as writer:
        timer = threading.Timer(0.5, writer.release.set)
        timer.start()
        engine.save_checkpoint(root, tag="first")
        engine.save_checkpoint(root, tag="second")  # waits for the first
        first_done = os.path.isdir(os.path.join(root, "first"))
        engine.destroy()                           # waits for the second
        second_done = os.path.isdir(os.path.join(root, "second"))
    with open(os.path.join(root, "latest")) as f:
        return first_done, second_done, f.read().splitlines()[0], writer.order


def test_a_second_save_and_destroy_wait_for_the_one_in_flight(pools, tmp_path):
    results = pools(WORLD).run(second_save_and_destroy_wait, str(tmp_path / "ckpt"))
    for first_done, second_done, latest, order in results:
        assert first_done and second_done and latest == "second", (first_done, second_done)
        assert [kind for kind, _ in order] == ["held", "writing", "held", "writing"]
    loaded = pools(WORLD).run(load_and_continue, str(tmp_path / "ckpt"))
    assert loaded[0]["path"].endswith("second")


KILL_SCRIPT = r"""
import os, sys, threading, time
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
from test_checkpoint import train
from test_checkpoint_async import make_engine
engine = make_engine(1)
train(engine, 0, 1, 1)
engine.save_checkpoint(sys.argv[1])
engine.wait_for_checkpoint()
train(engine, 0, 1, 1)
real = os.fsync
def stall(fd):  # the background save: stop mid-write and wait to be killed
    real(fd)
    if threading.current_thread().name == "vescale-checkpoint-writer":
        print("WRITING", flush=True)
        time.sleep(120)
os.fsync = stall
engine.save_checkpoint(sys.argv[1])
print("RETURNED", flush=True)
train(engine, 0, 1, 1)
time.sleep(120)
"""


def test_kill_during_the_background_write_leaves_the_previous_latest(tmp_path, pools):
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(root), str(free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT,  # the test folders on the path, as the ranks have them
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    seen = set()
    lines = []
    for line in proc.stdout:  # the save returned and the writer is inside its write
        lines.append(line)
        seen.add(line.strip())
        if {"WRITING", "RETURNED"} <= seen:
            break
    assert {"WRITING", "RETURNED"} <= seen, "".join(lines[-20:])
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert (root / "latest").read_text().splitlines()[0] == "global_step1"
    assert not (root / "global_step2").exists()
    loaded = pools(1).run(load_and_continue, str(root))
    assert loaded[0]["path"] == str(root / "global_step1")


def preemption_waits(rank, world, root):
    """vescale.save_on_signal with background saves: Preempted is raised only once the
    preemption checkpoint is published (the writer held for a moment to make it wait)."""
    import vescale_engine
    from vescale_engine import initialize
    import fsdp_models as fm
    cfg = copy.deepcopy(base_config(world))
    cfg["checkpoint"] = copy.deepcopy(DECOUPLED)
    cfg["vescale"]["save_on_signal"] = {"save_dir": root}
    engine, *_ = initialize(model=fm.make("gpt"), config=cfg)
    train(engine, rank, world, 1)
    result = None
    with _HeldWriter() as writer:
        threading.Timer(0.5, writer.release.set).start()
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            train(engine, rank, world, 1)
        except vescale_engine.Preempted as stop:
            published = os.path.isdir(stop.checkpoint)
            with open(os.path.join(root, "latest")) as f:
                latest = f.read().splitlines()[0]
            engine.destroy()
            result = published, latest, [kind for kind, _ in writer.order]
    assert result == (True, "global_step2", ["held", "writing"]), result


def test_the_preemption_save_is_published_before_preempted_is_raised(pools, tmp_path):
    pools(WORLD).run(preemption_waits, str(tmp_path / "ckpt"))


def hf_files(directory) -> dict:
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory))}


def background_hf_save(rank, world, root):
    """save_hf_checkpoint(background=True) writes the bytes of a synchronous one while two
    training steps run (its writer held until they did); a later one whose write fails (a full
    disk on rank 0) is raised on every rank at the same step and leaves the earlier files."""
    from vescale_engine.checkpoint import CheckpointWriteError, hf
    engine = make_engine(world, decoupled=False)  # the engine makes its writer when asked
    train(engine, rank, world, 2)
    engine.save_hf_checkpoint(os.path.join(root, "sync"), max_shard_size="20KB")
    real, release, order = hf._write_held, threading.Event(), []

    def held(*args):
        order.append("held")
        if not release.wait(timeout=120):
            raise TimeoutError("the writer was never released")
        order.append("writing")
        return real(*args)

    hf._write_held = held
    try:
        engine.save_hf_checkpoint(os.path.join(root, "async"), max_shard_size="20KB",
                                  background=True)
        after = train(engine, rank, world, 2)
        order.append("trained")
        release.set()
        engine.wait_for_checkpoint()
    finally:
        hf._write_held = real
    real_save = hf.save_file

    def full_disk(tensors, filename, metadata=None):
        if threading.current_thread().name == "vescale-checkpoint-writer":
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real_save(tensors, filename, metadata=metadata)

    hf.save_file = full_disk
    try:
        engine.save_hf_checkpoint(os.path.join(root, "async"), background=True)
        for _ in range(500):
            try:
                train(engine, rank, world, 1)
            except CheckpointWriteError as err:
                return {"after": after, "order": order, "step": engine.global_steps,
                        "error": str(err)}
        return {"step": None}
    finally:
        hf.save_file = real_save
        engine.destroy()


def test_a_background_hf_save_writes_a_synchronous_ones_bytes(pools, tmp_path):
    results = pools(WORLD).run(background_hf_save, str(tmp_path))
    plain = pools(WORLD).run(save_sync_or_async, str(tmp_path / "plain"), False)
    assert results[0]["order"] == ["held", "trained", "writing"]  # training went on
    assert results[0]["after"] == plain[0]["after"]  # the held save changed nothing
    sync, back = hf_files(tmp_path / "sync"), hf_files(tmp_path / "async")
    assert len([n for n in sync if n.endswith(".safetensors")]) > 1 and sync == back
    assert results[0]["step"] is not None and results[0]["step"] == results[1]["step"], results
    for r in results:
        assert "\n" not in r["error"] and "No space left" in r["error"], r["error"]
    assert hf_files(tmp_path / "async") == sync  # the failed save replaced nothing

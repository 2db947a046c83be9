"""Checkpoints move between torch's FSDP2 and our `fully_shard` through torch's own APIs, at
other world sizes: FSDP2 on 2 ranks trains and saves model and optimizer with
`get_state_dict` + `dcp.save`; ours on 3 ranks loads it (`dcp.load` + `set_state_dict`) and
saves again; FSDP2 on 2 ranks loads that. The model and optimizer state at each stop must be
exactly what FSDP2 saved (full state dicts compared bitwise), and a step after the round trip
must be FSDP2's own next step. Each stage is a fresh job (`vescale run`), as a user's."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

# the repository: tests/core/<package>/ is three folders down
ROOT = str(Path(__file__).resolve().parents[3])

SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    import vescale_engine  # every stage exits as ours do: after gloo's workers (launch/settle.py)
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    stage, engine, workdir = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from vescale_engine import fully_shard

    class Net(nn.Module):  # uneven sizes: no layout lines up across engines or world sizes
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(37, 12)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 20), nn.Tanh(),
                                                      nn.Linear(20, 12)) for _ in range(2))
            self.head = nn.Linear(12, 37)
        def forward(self, x):
            h = self.emb(x)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h)

    def batch(step):  # the same global batch of 12 sequences, split over any world size
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 37, (12, 9), generator=g)
        mine = tokens.chunk(world)[rank]
        return mine[:, :-1], mine[:, 1:]

    def step(model, opt, n):
        x, y = batch(n)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 37), y.reshape(-1),
                                           reduction="sum") / (12 * 8) * world
        loss.backward()
        opt.step()
        opt.zero_grad()

    torch.manual_seed({"save": 0, "resave": 1, "load": 2}[stage])
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def save_full(name):
        msd, osd = get_state_dict(model, opt, options=full)
        if rank == 0:
            torch.save({"model": msd, "optim": osd}, f"{workdir}/{name}.pt")

    if stage == "save":
        for n in range(2):
            step(model, opt, n)
        save_full("saved")
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{workdir}/ckpt_a")
        step(model, opt, 2)  # FSDP2's own next step, the reference for the round trip
        save_full("next")
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        source = "ckpt_a" if stage == "resave" else "ckpt_b"
        dcp.load(state, checkpoint_id=f"{workdir}/{source}")
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        save_full(f"loaded_{stage}")
        if stage == "resave":
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{workdir}/ckpt_b")
        else:
            step(model, opt, 2)
            save_full("next_after_round_trip")
    dist.barrier()
    dist.destroy_process_group()
""")


def _stage(tmp_path, stage, engine, nproc):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "run", "--nproc", str(nproc),
                           str(script), stage, engine, str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, f"{stage} ({engine}, {nproc} ranks): " + \
        done.stdout[-3000:] + done.stderr[-3000:]


def _differences(a, b, path=""):
    """Paths where two nested state dicts differ (tensors bitwise; everything else ==)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: missing on one side" for k in a.keys() ^ b.keys()]
        for k in a.keys() & b.keys():
            out += _differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [f"{path}: {a!r:.60} vs {b!r:.60}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def test_fsdp2_to_ours_to_fsdp2_at_other_world_sizes(tmp_path):
    _stage(tmp_path, "save", "fsdp2", 2)
    _stage(tmp_path, "resave", "ours", 3)
    _stage(tmp_path, "load", "fsdp2", 2)
    saved = torch.load(tmp_path / "saved.pt")
    for name in ("loaded_resave", "loaded_load"):
        got = torch.load(tmp_path / f"{name}.pt")
        assert _differences(saved, got) == [], name
    assert saved["optim"]["state"], "the optimizer state was saved"
    assert _differences(saved, torch.load(tmp_path / "next.pt")), "a step changes the state"
    # the step after FSDP2 -> ours -> FSDP2 is FSDP2's own next step
    assert _differences(torch.load(tmp_path / "next.pt"),
                        torch.load(tmp_path / "next_after_round_trip.pt")) == []

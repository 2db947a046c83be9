"""Saves that do not stop training: `save_checkpoint(..., background=BackgroundSaves(...))`.

The calling thread copies this rank's state into host memory (`stage`: buffers kept between
saves, pinned when the state is on an accelerator) and returns; a thread writes the files and
publishes them exactly as a synchronous save does (sharded.py: DCP into `.TAG.partial`, every
rank's files checksummed, rank 0's rename, then `latest`), its collectives on a process group
of its own, so they never interleave with training's.

At most one save is in flight. What the thread leaves is taken up on every rank at once, at
a collective point the training loop reaches on every rank alike (`poll`: the engine's step;
`wait`: the next save, a load, destroy): a failure is raised there on every rank, as one line,
never on some ranks while the others go on into the next collective. A process killed while
the thread writes leaves only the partial directory: the previous `latest` stays loadable.
"""
from __future__ import annotations

import copy
import threading
import time

import torch
import torch.distributed as dist

from ..shard.ragged_piece import RaggedPiece
from .dcp import CheckpointWriteError

__all__ = ["BackgroundSaves"]


class BackgroundSaves:
    """One engine's background saves. Making it is a collective (its process group)."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")  # the writer threads' collectives
        self._staged = {}     # key -> host tensor, reused by the next save
        self._thread = None
        self._path = None
        self._error = None

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def stage(self, sd: dict) -> dict:
        """`sd` with every tensor copied into this object's host buffers (a RaggedPiece keeps
        its boxes over the copy); a tensor shared by several keys is copied once."""
        staged, copies = {}, {}
        for key, value in sd.items():
            local = value.local if isinstance(value, RaggedPiece) else value
            if id(local) not in copies:
                copies[id(local)] = self._host_copy(key, local)
            if isinstance(value, RaggedPiece):
                value = copy.copy(value)
                value.local = copies[id(local)]
                staged[key] = value
            else:
                staged[key] = copies[id(local)]
        return staged

    def _host_copy(self, key, tensor: torch.Tensor) -> torch.Tensor:
        held = self._staged.get(key)
        if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
            held = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                               pin_memory=tensor.device.type == "cuda")
            self._staged[key] = held
        held.copy_(tensor.detach(), non_blocking=tensor.device.type == "cuda")
        return held

    def start(self, path: str, write, staged: dict) -> None:
        """Run `write(staged, group, started)` in the writer thread (after the copies that
        staging queued on an accelerator have landed)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
        started = time.perf_counter()

        def run():
            try:
                write(staged, self.group, started)
            except BaseException as err:  # taken up on every rank by poll / wait
                self._error = err

        self._path, self._error = path, None
        self._thread = threading.Thread(target=run, name="vescale-checkpoint-writer",
                                        daemon=True)
        self._thread.start()

    def poll(self, device) -> None:
        """At a point every rank reaches alike (a collective when a save is in flight):
        forget a save that every rank finished; raise, on every rank, when any rank's
        failed."""
        if not self.pending:
            return
        finished = not self._thread.is_alive()
        failed = finished and self._error is not None
        flags = torch.tensor([0 if finished else 1, 1 if failed else 0], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1].item():
            self.wait(device)  # raises on every rank
        elif not flags[0].item():
            self._thread = None

    def wait(self, device=None) -> None:
        """Until the save in flight is written and published on every rank; its failure is
        raised on every rank (a collective when one is in flight)."""
        if not self.pending:
            return
        self._thread.join()
        error, path = self._error, self._path
        self._thread = self._error = None
        flag = torch.tensor([1 if error is not None else 0],
                            device=device if device is not None else _default_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        original = error
        if error is not None and not isinstance(error, CheckpointWriteError):
            error = CheckpointWriteError(getattr(error, "errno", None),
                                         f"save_checkpoint: the background save of {path} "
                                         f"failed: {type(error).__name__}: "
                                         f"{(str(error).splitlines() or [''])[0]}")
        # every rank raises the first failing rank's line (an HF save fails on rank 0 only)
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, None if error is None else (error.errno, str(error)))
        rank, (code, line) = next((r, f) for r, f in enumerate(found) if f is not None)
        if error is not None and rank == dist.get_rank():
            raise error from (original if original is not error else None)
        raise CheckpointWriteError(code, line if "(rank " in line else f"{line} (rank {rank})")


def _default_device():
    backend = dist.get_backend()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

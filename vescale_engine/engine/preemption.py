"""The preemption save (`vescale.save_on_signal`): on SIGTERM (Kubernetes, SLURM's
`--signal`, a launcher forwarding it before its grace period ends) the engine finishes the
optimizer step in progress, saves a checkpoint at a step every rank agrees on, and
`engine.step()` raises `Preempted` (a SystemExit: status 128 + the signal, 143 for SIGTERM).

The signal reaches ranks at different times, so a rank only records it; at each optimizer
step every rank contributes the signal it recorded (0 for none) to one MAX all-reduce of one
element, issued before the gradient norm and read after the optimizer's kernels are queued.
Every rank reads the same result at the same step, so they all save that step's state and
exit with the same status. Cost, only while the key is set: that one-element all-reduce per
optimizer step, and on a GPU the host waits for it at the end of step() (it cannot queue more
than one step ahead; the GPU keeps running the queued optimizer kernels meanwhile).

Repeated signals while the save is pending or running are recorded, not acted on: a launcher
and a terminal often both deliver one (Ctrl-C reaches the whole process group, the launcher
forwards it again), and interrupting the save would waste the grace period. The hard stop is
the supervisor's SIGKILL; a kill mid-save leaves `latest` on the previous checkpoint (saves
are atomic: checkpoint/layout.py). Handlers are installed by initialize (main thread only)
and the previous ones restored by engine.destroy(); a process forked afterwards (a DataLoader
worker) inherits them but takes the signal's default action.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

import torch
import torch.distributed as dist

from config_schemas.validate import ConfigError

from ..launch.collective_timeout import explain_timeout

__all__ = ["Preempted", "SignalSave"]

LOG = logging.getLogger("vescale_engine")


class Preempted(SystemExit):
    """Raised by engine.step() once the preemption checkpoint is saved. Uncaught, the process
    exits with `code` = 128 + `signum`, the shell's convention for death by that signal;
    `checkpoint` is the directory saved, `global_steps` the step it holds."""

    def __init__(self, signum: int, checkpoint: str, global_steps: int):
        super().__init__(128 + signum)
        self.signum, self.checkpoint, self.global_steps = signum, checkpoint, global_steps

    def __str__(self):
        return (f"preempted by {signal.Signals(self.signum).name}: checkpoint {self.checkpoint} "
                f"(step {self.global_steps}) saved; exit status {self.code}")


class SignalSave:
    """Records the configured signals and runs the agreement at each optimizer step."""

    def __init__(self, spec, device: torch.device):
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(["vescale.save_on_signal: initialize must run on the main thread "
                               "(Python installs signal handlers only there)"])
        self.spec = spec
        self.received = 0      # the first configured signal this rank got (0: none)
        self.repeats = 0       # signals after the first, not acted on
        self._vote = torch.zeros(1, dtype=torch.int32, device=device)
        self._previous = {}
        self._pid = os.getpid()
        for name in spec.signals:
            number = signal.Signals[name]
            self._previous[number] = signal.signal(number, self._record)
            signal.siginterrupt(number, False)  # system calls in C++ (gloo, files) restart

    def _record(self, signum, frame):
        if os.getpid() != self._pid:  # a forked child (a DataLoader worker): default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        # Only note it: the main thread is anywhere (inside a collective, a file write).
        if self.received:
            self.repeats += 1
        else:
            self.received = signum

    def vote(self):
        """At the start of the optimizer step, before the gradient norm: MAX over the ranks
        of the signal each recorded. fill_ with a number queues a kernel: no host sync."""
        self._vote.fill_(self.received)
        with explain_timeout("the all-reduce of the preemption vote"):
            dist.all_reduce(self._vote, op=dist.ReduceOp.MAX)

    def save_if_agreed(self, engine):
        """After the optimizer step, once its kernels are queued: read the agreed signal (the
        same on every rank); if there is one, save this step's checkpoint and raise Preempted
        on every rank."""
        signum = int(self._vote.item())
        if not signum:
            return
        name = signal.Signals(signum).name
        if engine.global_rank == 0:
            LOG.warning("vescale.save_on_signal: %s received; saving step %d to %s before "
                        "exiting", name, engine.global_steps, self.spec.save_dir)
        path = engine.save_checkpoint(self.spec.save_dir,
                                      tag=self.spec.tag_at(engine.global_steps))
        engine.wait_for_checkpoint()  # a background save finished before the process exits
        self.received = self.repeats = 0  # a loop that catches Preempted trains on clean
        stop = Preempted(signum, path, engine.global_steps)
        if engine.global_rank == 0:
            LOG.warning("%s", stop)
        raise stop

    def close(self):
        """Restore the handlers that were there before."""
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}


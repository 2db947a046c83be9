"""DeepSpeed's `csv_monitor` and `tensorboard` keys: training scalars written on rank 0.

Events are (name, value, step) with DeepSpeed's names ("Train/Samples/train_loss", ...) and the
global sample count as the step. The CSV monitor writes one file per name,
`output_path/job_name/Train_Samples_train_loss.csv`, with a `step,<last name part>` header, as
DeepSpeed's csvMonitor does. TensorBoard is used only when `torch.utils.tensorboard` imports;
otherwise the log says so once and training goes on.
"""
from __future__ import annotations

import csv
import logging
import os
from collections import deque

import torch

__all__ = ["CsvMonitor", "TensorBoardMonitor", "Monitors", "PendingScalars"]

LOG = logging.getLogger("vescale_engine")
DEFAULT_JOB_NAME = "DeepSpeedJobName"


def _log_dir(section: dict) -> str:
    return os.path.join(section.get("output_path", ""), section.get("job_name", DEFAULT_JOB_NAME))


class CsvMonitor:
    def __init__(self, section: dict):
        self.log_dir = _log_dir(section)
        os.makedirs(self.log_dir, exist_ok=True)
        self._started = set()  # files this run has written a header to

    def write_events(self, events) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            path = os.path.join(self.log_dir, filename + ".csv")
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if filename not in self._started:
                    self._started.add(filename)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass  # every write opens and closes its file


class TensorBoardMonitor:
    def __init__(self, section: dict, summary_writer_cls):
        self.log_dir = _log_dir(section)
        os.makedirs(self.log_dir, exist_ok=True)
        self.writer = summary_writer_cls(log_dir=self.log_dir)

    def write_events(self, events) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _summary_writer_cls():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


class Monitors:
    """Every enabled monitor, on rank 0 only (other ranks hold none and write nothing)."""

    def __init__(self, config: dict, rank: int):
        self.monitors = []
        if rank != 0:
            return
        if config.get("csv_monitor", {}).get("enabled", False):
            self.monitors.append(CsvMonitor(config["csv_monitor"]))
        if config.get("tensorboard", {}).get("enabled", False):
            writer_cls = _summary_writer_cls()
            if writer_cls is None:
                LOG.warning("tensorboard.enabled is set but torch.utils.tensorboard does not "
                            "import (pip install tensorboard); TensorBoard events are not written")
            else:
                self.monitors.append(TensorBoardMonitor(config["tensorboard"], writer_cls))

    @property
    def enabled(self) -> bool:
        return bool(self.monitors)

    def write_events(self, events) -> None:
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []


class PendingScalars:
    """Events whose values may be device tensors (the loss, the gradient norm). Each step's
    values are copied to the host without waiting, and written once the copy has landed, in
    step order: a GPU step never waits for its loss to reach the host. `wait=True` (the
    progress line's steps, teardown) writes everything, waiting once."""

    def __init__(self, monitors: Monitors):
        self.monitors = monitors
        self._queue = deque()  # (events with host values, marker of their copy or None)

    def add(self, events) -> None:
        host, device = [], None
        for name, value, step in events:
            if isinstance(value, torch.Tensor):
                if value.device.type != "cpu":
                    device = value.device
                value = value.detach().to("cpu", non_blocking=True)
            host.append((name, value, step))
        self._queue.append((host, None if device is None else _copy_done_marker(device)))

    def write_ready(self, wait: bool = False) -> None:
        while self._queue:
            events, marker = self._queue[0]
            if marker is not None:
                if wait:
                    marker.synchronize()
                elif not marker.query():
                    return  # later steps' copies are queued behind this one
            self._queue.popleft()
            self.monitors.write_events([(n, float(v), s) for n, v, s in events])

    def __len__(self) -> int:
        return len(self._queue)


def _copy_done_marker(device: torch.device):
    """An event after the copies just queued on `device`'s current stream."""
    event = torch.Event(device=device)
    event.record()
    return event

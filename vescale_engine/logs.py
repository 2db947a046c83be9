"""The library's logger, "vescale_engine", as a script sees it without any logging setup.

DeepSpeed's logger prints on its own (a handler of its own on stdout), so a DeepSpeed script
shows its progress line and checkpoint messages with no `logging.basicConfig`. Ours does the
same: INFO lines go to stdout and warnings to stderr as `[vescale] message` until the application configures
logging itself (a handler on the root logger), from then on its handlers take the records (they
propagate) and ours stays quiet, so nothing prints twice. Silence it the usual ways:
`logging.getLogger("vescale_engine").setLevel(logging.WARNING)`, or `VESCALE_LOG_LEVEL=warning`
in the environment. `install` sets this up; importing the package does not: initialize,
fully_shard, materialize and the launcher call it first.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys

LOGGER_NAME = "vescale_engine"
LEVEL_VARIABLE = "VESCALE_LOG_LEVEL"


class _UntilConfigured(logging.StreamHandler):
    """INFO to stdout, warnings and errors to stderr (where Python's last-resort handler put
    them before), while the root logger has no handler; then the application's handlers print."""

    def __init__(self):
        super().__init__(stream=None)
        self.setFormatter(logging.Formatter("[vescale] %(message)s"))
        self._to_stderr = False

    @property
    def stream(self):  # the streams as they are now (pytest and launchers replace them)
        return sys.stderr if self._to_stderr else sys.stdout

    @stream.setter
    def stream(self, value):
        pass

    def emit(self, record):
        if logging.getLogger().handlers:
            return
        self._to_stderr = record.levelno >= logging.WARNING
        super().emit(record)


def install() -> logging.Logger:
    """Give the library's logger its default handler and level (idempotent). A level set in
    the environment wins; one the application set before is kept."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, _UntilConfigured) for h in logger.handlers):
        logger.addHandler(_UntilConfigured())
    wanted = os.environ.get(LEVEL_VARIABLE, "").strip().upper()
    if wanted:
        level = logging.getLevelName(wanted)
        if not isinstance(level, int):
            raise ValueError(f"{LEVEL_VARIABLE}={os.environ[LEVEL_VARIABLE]!r} is not a logging "
                             "level (debug, info, warning, error, critical)")
        logger.setLevel(level)
    elif logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    return logger


# DeepSpeed's warnings that the engine's own start triggers and that say nothing to its user.
DEEPSPEED_START_NOISE = (
    # DeepSpeed picks its CPU accelerator when it finds no GPU (the engine uses gloo there)
    "Setting accelerator to CPU.",
    # WarmupLR and its kin ask themselves for an lr in their constructor; they are stepped
    # after each optimizer step, as under DeepSpeed
    "Attempting to get learning rate from scheduler before it has started",
)


class _DropStartNoise(logging.Filter):
    def filter(self, record):
        message = record.getMessage()
        return not any(message.startswith(noise) for noise in DEEPSPEED_START_NOISE)


@contextlib.contextmanager
def quiet_deepspeed_start():
    """Inside (the engine's `initialize`), DeepSpeed's logger drops DEEPSPEED_START_NOISE; a
    script's own DeepSpeed calls outside still print them."""
    logger = logging.getLogger("DeepSpeed")
    noise = _DropStartNoise()
    logger.addFilter(noise)
    try:
        yield
    finally:
        logger.removeFilter(noise)

"""A collective that times out says so in one line: which operation, after how long, the config
key that sets the limit (vescale.process_group_timeout_s), and what the job's store knows about
the other ranks (a rank that failed first). The backends' own messages name none of these
(gloo: "Timed out waiting 600000ms for recv operation to complete").

    with explain_timeout("all-gather of unit 'blocks.3' (forward)"):
        work.wait()
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist

TIMEOUT_KEY = "vescale.process_group_timeout_s"
# How gloo, NCCL's watchdog and the store word a timeout.
_TIMEOUT_WORDS = ("timed out", "timeout", "deadline exceeded")


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process group's timeout."""


_state = {"timeout_s": None, "failure": None}  # set by process_group when the group forms


def record_group(timeout_s: float, failure_of=None):
    """The group's timeout, and a callable that returns the job's first failure record
    ("rank R: <line>") or None: what the messages say about the other ranks."""
    _state.update(timeout_s=timeout_s, failure=failure_of)


def is_timeout(err: BaseException) -> bool:
    if not isinstance(err, (RuntimeError, dist.DistError)) or isinstance(err, CollectiveTimeout):
        return False
    text = str(err).lower()
    return any(word in text for word in _TIMEOUT_WORDS)


def timeout_message(operation: str, err: BaseException) -> str:
    """One line for `err`, a timeout in `operation`, on this rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    limit = _state["timeout_s"]
    within = f"within {limit:g} s" if limit is not None else "within the process group's timeout"
    others = _others()
    backend = (str(err).strip().splitlines() or [""])[0][:200]
    return (f"rank {rank} of {world}: {operation} did not complete {within} "
            f"({TIMEOUT_KEY}); {others} ({type(err).__name__}: {backend})")


@contextlib.contextmanager
def explain_timeout(operation: str):
    """Turn a backend's timeout error inside the block into a CollectiveTimeout with one line
    (timeout_message); every other error passes unchanged."""
    try:
        yield
    except (RuntimeError, dist.DistError) as err:
        if not is_timeout(err):
            raise
        raise CollectiveTimeout(timeout_message(operation, err)) from err


def _others() -> str:
    failure_of = _state["failure"]
    first = None
    if failure_of is not None:
        try:
            first = failure_of()
        except Exception:  # noqa: BLE001 - the store is gone with its host
            return "the job's store does not answer (rank 0, its host, may have exited)"
    if first:
        return f"rank {first} failed first"
    return ("no rank reported a failure: a rank is stuck or slower than the limit, or the "
            "ranks called different collectives")

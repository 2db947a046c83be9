"""DeepSpeed before 0.19.8 gathers ZeRO-3 parameters on gloo with a race: in
`Init._allgather_params_coalesced` it launches one asynchronous all-gather per parameter and
waits only for the last (NCCL runs them in order on one stream; gloo runs asynchronous work on
several threads, so the others may still be writing). The gathered values are then partly
another tensor's memory: seen here as DeepSpeed's own `from_config` giving a norm weight of
random values instead of ones, now and then, at the lowest supported versions. 0.19.8 waits for
every handle. The tests compare the engine against DeepSpeed, so the reference must be right:
in the ranks of the test pools that run DeepSpeed, those all-gathers complete before returning
(what 0.19.8 does). The engine itself does not use that path."""
from __future__ import annotations


class _WaitingComm:
    """deepspeed.comm as partition_parameters sees it, with all_gather waited for."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def all_gather(self, *args, **kwargs):
        handle = self._comm.all_gather(*args, **kwargs)
        if kwargs.get("async_op") and handle is not None:
            handle.wait()
        return handle


def install() -> bool:
    """Patch DeepSpeed < 0.19.8 (idempotent); True when the patch is in place."""
    import deepspeed
    from packaging.version import Version
    if Version(deepspeed.__version__) >= Version("0.19.8"):
        return False
    from deepspeed.runtime.zero import partition_parameters
    if not isinstance(partition_parameters.dist, _WaitingComm):
        partition_parameters.dist = _WaitingComm(partition_parameters.dist)
    return True

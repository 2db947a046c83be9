"""DeepSpeed's Ulysses sequence parallelism (ALST) under this engine (docs/parallelism.md).

What is DeepSpeed's and stays DeepSpeed's: the groups (`parallel_state_sp`, made by
`UlyssesSPAttentionHF.register_with_transformers`, which returns that module as the `mpu`), the
attention (`UlyssesSPAttentionHF`: all-to-all from sequence chunks to head groups and back),
the data (`UlyssesSPDataLoaderAdapter`: one sample per SP rank, split along the sequence) and
the tiled MLP and loss. What is the engine's: the parameters stay sharded over every rank, as
DeepSpeed's ZeRO shards over its sequence-data-parallel group, and the gradients are summed
over every rank and divided by the world size. Each SP rank back-propagates the whole gathered
loss, so the sum over an SP group is sp times that sequence's gradient; over the world it is
sp x dp times the one-process gradient of the global batch: dividing by the world size (what
sharding over every rank does anyway) gives the one-process gradient, as DeepSpeed's does.
deepspeed.initialize (integrations/deepspeed/) then gives DeepSpeed's groups the mpu, as
DeepSpeed's engine does, and the DeepSpeed integration's `sequence_parallel_loader` the data
loader (engine/extensions.py).
"""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["sequence_parallel_size"]


def sequence_parallel_size(mpu) -> int:
    """The size of the sequence-parallel groups of `mpu` (None: 1), checked without a
    collective. Recognised as DeepSpeed recognises it, by `initialize_sequence_parallel`; any
    other mpu (Megatron's model-parallel units) is one ValueError line."""
    if mpu is None:
        return 1
    if not hasattr(mpu, "initialize_sequence_parallel"):
        raise ValueError(f"mpu {getattr(mpu, '__name__', type(mpu).__name__)}: only DeepSpeed's "
                         "sequence-parallel mpu (deepspeed's UlyssesSPAttentionHF."
                         "register_with_transformers returns it) is supported; for tensor or "
                         "expert parallelism set tensor_parallel.autotp_size or "
                         "expert_parallel.autoep_size in the config and the engine builds the "
                         "groups")
    for name in ("get_sequence_parallel_group", "get_sequence_parallel_world_size",
                 "get_sequence_parallel_rank"):
        if not callable(getattr(mpu, name, None)):
            raise ValueError(f"the sequence-parallel mpu has no {name}()")
    size = int(mpu.get_sequence_parallel_world_size())
    if size > 1:
        ranks = dist.get_process_group_ranks(mpu.get_sequence_parallel_group())
        first = dist.get_rank() // size * size
        if ranks != list(range(first, first + size)):
            raise ValueError(f"the mpu's sequence-parallel group of rank {dist.get_rank()} is "
                             f"ranks {ranks}: the engine needs groups of consecutive ranks, as "
                             "DeepSpeed's initialize_sequence_parallel makes them")
    return size

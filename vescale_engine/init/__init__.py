"""Building a model for sharding: `deepspeed.zero.Init` on the meta device under a vescale
config (zero.py), which leaves fsdp/deferred.py's record on what it built, transformers'
from_pretrained/from_config under it (hf_pretrained.py); PEFT adapters added to such a model:
integrations/peft/. Must not know about the engine or its config: initialize reads the record.
"""
from ..fsdp.deferred import MARK, DeferredInit, deferred_record, replayed_generator

__all__ = ["MARK", "DeferredInit", "deferred_record", "replayed_generator"]

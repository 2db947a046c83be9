"""Optimizers that step whole DBuffer shards at once."""
from .adamw import AdamW

__all__ = ["AdamW"]

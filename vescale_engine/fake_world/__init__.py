"""One training step of ours or torch FSDP2 on a model a shapes file describes, run for real as
rank 0 of W on torch's fake process group, its collectives recorded with the unit and phase
each belongs to (`vescale plan --time --fake-world`). stand_in.py builds the model (on meta,
every shape of the file); record.py wraps it, runs the step and records it."""
from .record import record_step

__all__ = ["record_step"]

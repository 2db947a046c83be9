"""A vescale checkpoint directory's layout on disk and its atomic publication (checkpoint.py
describes the layout): the names every checkpoint module agrees on, and the renames that make a
finished checkpoint visible. Must not know what the files hold.
"""
from __future__ import annotations

import os
import shutil

from .entries import fsync_dir

__all__ = ["FORMAT", "STATE_FILE", "LATEST_FILE", "publish"]

FORMAT = "vescale-dcp/1"
STATE_FILE = "vescale_state.json"
LATEST_FILE = "latest"


def publish(save_dir, partial, final, tag, save_latest):
    """Make the finished checkpoint visible, then point `latest` at it: renames only."""
    if os.path.exists(final):  # saving a tag again replaces it
        old = os.path.join(save_dir, f".{tag}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, final)
    fsync_dir(save_dir)
    if save_latest:
        tmp = os.path.join(save_dir, f".{LATEST_FILE}.tmp")
        with open(tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(save_dir, LATEST_FILE))
        fsync_dir(save_dir)

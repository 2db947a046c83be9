"""A vescale checkpoint directory's layout on disk and its atomic publication (checkpoint.py
describes the layout): the names every checkpoint module agrees on, the renames that make a
finished checkpoint visible, and `latest`. Must not know what the files hold.

`latest` holds the newest tag and nothing else, as DeepSpeed writes it (its `zero_to_fp32` and
every tool that reads `latest` find the tag); `latest.crc32` beside it holds
`crc32:XXXXXXXX`, the tag's CRC32, so a damaged `latest` is an error naming it, never another
checkpoint. A `latest` without it (DeepSpeed's own) is read unchecked (load_checkpoint warns
unless it names a DeepSpeed checkpoint); one that disagrees with it (damaged, or edited by
hand) is an error saying how to load it anyway. Older versions wrote the checksum as a second
line of `latest`: still read.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import zlib

from .dcp import CheckpointError
from .entries import fsync_dir, write_atomically

__all__ = ["FORMAT", "STATE_FILE", "LATEST_FILE", "LATEST_CHECKSUM_FILE", "publish",
           "write_latest", "read_latest", "partial_dir", "remove_partials", "bad_tag"]

FORMAT = "vescale-dcp/1"
STATE_FILE = "vescale_state.json"
LATEST_FILE = "latest"
LATEST_CHECKSUM_FILE = "latest.crc32"
_PARTIAL = re.compile(r"\..+\.partial")
_CRC_LINE = re.compile(r"crc32:([0-9a-f]{8})")


def bad_tag(tag: str) -> str | None:
    """Why `tag` cannot name a checkpoint directory, or None."""
    if not tag:
        return "it is empty"
    if "/" in tag or "\\" in tag or tag.startswith(".") or tag in (LATEST_FILE,
                                                                      LATEST_CHECKSUM_FILE):
        return f"{tag!r} is not a directory name of this save directory"
    if not tag.isprintable() or tag != tag.strip():
        return f"{tag!r} holds control or surrounding space characters"
    return None


def partial_dir(save_dir, tag) -> str:
    """Where a save writes before it is published."""
    return os.path.join(save_dir, f".{tag}.partial")


def remove_partials(save_dir) -> list:
    """Remove what interrupted saves left (`.TAG.partial` directories, any tag): they are
    never loaded and may hold the space the next save needs. The names removed."""
    removed = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if _PARTIAL.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
            removed.append(name)
    return removed


def publish(save_dir, partial, final, tag, save_latest):
    """Make the finished checkpoint visible, then point `latest` at it: renames only. A
    failure leaves the previous checkpoint of the tag (if any) and `latest` as they were."""
    if os.path.exists(final):  # saving a tag again replaces it
        old = os.path.join(save_dir, f".{tag}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        try:
            os.rename(partial, final)
        except OSError:
            os.rename(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, final)
    fsync_dir(save_dir)
    if save_latest:
        write_latest(save_dir, tag)


def write_latest(save_dir, tag) -> None:
    """Point `latest` at `tag` (by rename: a failure leaves the old one)."""
    checksum = os.path.join(save_dir, LATEST_CHECKSUM_FILE)
    before = None
    if os.path.isfile(checksum):
        with open(checksum, "rb") as f:
            before = f.read(64)
    write_atomically(checksum, f"crc32:{zlib.crc32(tag.encode()):08x}\n".encode())
    try:
        write_atomically(os.path.join(save_dir, LATEST_FILE), tag.encode())
    except BaseException:  # `latest` still names the previous tag: so must its checksum
        try:
            if before is None:
                os.remove(checksum)
            else:
                write_atomically(checksum, before)
        except OSError:  # (a full disk): unchecked rather than contradicting `latest`
            with contextlib.suppress(OSError):
                os.remove(checksum)
        raise
    fsync_dir(save_dir)


def read_latest(latest) -> tuple[str, bool]:
    """(the tag `latest` names, whether a checksum vouched for it): one line naming the file
    if it is damaged. A `latest` without a checksum (DeepSpeed's, an older version's, one
    written by hand) gives (tag, False); a wrong checksum is an error."""
    try:
        with open(latest, "rb") as f:
            raw = f.read(4096)
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{latest} is corrupted: not text") from None
    lines = text.strip().splitlines()
    if not lines:
        raise CheckpointError(f"{latest} is empty")
    if len(raw) == 4096 or len(lines) > 2:
        raise CheckpointError(f"{latest} is corrupted: not a tag and its checksum "
                              f"({len(lines)} lines)")
    tag = lines[0]
    problem = bad_tag(tag)
    if problem:
        raise CheckpointError(f"{latest} is corrupted: the tag {problem}")
    if len(lines) == 2:  # an older version's: the checksum on the second line
        if not _matches(lines[1], tag):
            raise CheckpointError(f"{latest} is corrupted: tag {tag!r} does not match its "
                                  "checksum line (edited by hand? then leave only the tag)")
        return tag, True
    checksum = os.path.join(os.path.dirname(latest), LATEST_CHECKSUM_FILE)
    if not os.path.isfile(checksum):
        return tag, False
    with open(checksum, "rb") as f:
        line = f.read(64).decode("utf-8", "replace").strip()
    if not _matches(line, tag):
        raise CheckpointError(f"{latest} names tag {tag!r}, which {checksum} does not vouch for "
                              "(damaged, or edited by hand: then remove "
                              f"{LATEST_CHECKSUM_FILE} to load it unchecked)")
    return tag, True


def _matches(line: str, tag: str) -> bool:
    match = _CRC_LINE.fullmatch(line)
    return bool(match) and int(match.group(1), 16) == zlib.crc32(tag.encode())

"""Checkpoints under faults (issue 23): bad bytes are refused with one line naming the file and
every file is left as it was (sha256 before and after); checkpoints written before checksums
still load; a full disk while saving is one line naming the path and the bytes needed, leaves
`latest` and the complete checkpoints untouched, and the next save succeeds with no `.partial`
left. The full disk is injected: in the ranks, `open` (and `io.open`, which DCP's writer uses)
hands out files whose writes raise OSError(ENOSPC) for the names a case picks."""
import builtins
import contextlib
import errno
import fnmatch
import hashlib
import io
import json
import os
import random
import re
import shutil
import struct
import time
import warnings

import pytest
import torch

import fsdp_models as fm
from dist_harness import scratch_dir

GLOBAL = 4
FAIL_WITHIN_S = 15  # a failed save returns on every rank within this (the pool's timeout: 180 s)


def make_engine(world):
    from vescale_engine import initialize
    cfg = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": GLOBAL // world,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95]}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                        "warmup_num_steps": 4}},
           "vescale": {"wrap_policy": {"module_classes": ["Block"]},
                       "granularity": {"default": "rows:4"}}}
    torch.manual_seed(0)
    model = fm.GPT(dim=32, heads=2, layers=1)
    engine, *_ = initialize(model=model, config=cfg)
    return engine


def train(engine, rank, world, steps):
    return fm.train_steps(engine, rank, world, steps, GLOBAL)


def digests(root) -> dict:
    """sha256 of every file under `root` (relative path -> hex digest)."""
    out = {}
    for where, _, names in os.walk(root):
        for name in names:
            path = os.path.join(where, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def leftovers(root) -> list:
    return sorted(n for n in os.listdir(root) if n.endswith((".partial", ".tmp", ".old")))




# -- safetensors: the format's rules, as the `safetensors` package enforces them -------------------

def _write_raw(path, header: dict, data: bytes):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def _read_raw(path):
    blob = open(path, "rb").read()
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _doctored_safetensors(good, out_dir):
    """{case: file} of copies of `good` (tensors a, b: F32 [16]; c: I64 [2]) with bad headers."""
    header, data = _read_raw(good)

    def variant(name, edit, new_data=None):
        h = json.loads(json.dumps(header))
        edit(h)
        path = os.path.join(out_dir, f"{name}.safetensors")
        _write_raw(path, h, data if new_data is None else new_data)
        return path

    def shift_all(h):  # every tensor 64 bytes further on
        for k, v in h.items():
            if k != "__metadata__":
                v["data_offsets"] = [v["data_offsets"][0] + 64, v["data_offsets"][1] + 64]

    def alias(h):  # b points at a's bytes
        h["b"]["data_offsets"] = list(h["a"]["data_offsets"])

    def gap(h):  # 8 unused bytes between a and b, the rest shifted
        for k in ("b", "c"):
            h[k]["data_offsets"] = [o + 8 for o in h[k]["data_offsets"]]

    def past_end(h):
        h["c"]["data_offsets"][1] += 8
        h["c"]["shape"] = [3]

    def size(h):  # F16 needs 32 bytes for 16 elements, the file gives 64
        h["a"]["dtype"] = "F16"

    def negative(h):
        h["a"]["data_offsets"] = [-8, 56]

    a_end = header["a"]["data_offsets"][1]
    return {"shifted by 64": variant("shift", shift_all),
            "aliased": variant("alias", alias),
            "gap": variant("gap", gap, data[:a_end] + bytes(8) + data[a_end:]),
            "past the end": variant("past", past_end),
            "size for the dtype": variant("size", size),
            "negative offset": variant("negative", negative),
            "trailing bytes": variant("trailing", lambda h: None, data + bytes(8))}


def test_safetensors_reader_refuses_what_the_format_forbids(tmp_path):
    from safetensors import safe_open

    from vescale_engine.checkpoint.safetensors_format import load_file, read_header, save_file
    good = str(tmp_path / "good.safetensors")
    save_file({"a": torch.randn(16), "b": torch.randn(16), "c": torch.arange(2)}, good)
    assert sorted(load_file(good)) == ["a", "b", "c"]
    bad = _doctored_safetensors(good, str(tmp_path))
    before = digests(tmp_path)
    expected = {"shifted by 64": "leaves bytes [0, 64) unused", "aliased": "overlaps tensor",
                "gap": "leaves bytes [64, 72) unused", "past the end": "past the end",
                "size for the dtype": "its shape [16] of F16 takes 32",
                "negative offset": "malformed header entry",
                "trailing bytes": "the file has 152 bytes of data"}
    for case, path in bad.items():
        for read in (lambda p: read_header(open(p, "rb"), p), load_file):
            with pytest.raises(ValueError) as caught:
                read(path)
            message = str(caught.value)
            assert message.startswith(path + ": ") and "\n" not in message, (case, message)
            assert expected[case] in message, (case, message)
        with pytest.raises(Exception):  # the reference implementation refuses it as well
            with safe_open(path, "pt") as f:
                [f.get_tensor(k) for k in f.keys()]
    assert digests(tmp_path) == before


# -- Hugging Face loads: the file's dtype must be one the parameter can take -----------------------

def hf_bad_bytes(rank, world, root):
    from vescale_engine.checkpoint.hf import load_hf_checkpoint
    from vescale_engine.fsdp import full_state_dict
    engine = make_engine(world)
    good = os.path.join(root, "hf")
    engine.save_hf_checkpoint(good, dtype="fp32")
    cases = {}
    if rank == 0:
        file = os.path.join(good, "model.safetensors")
        header, data = _read_raw(file)
        labels = dict(header)
        labels["wte.weight"] = {**header["wte.weight"], "dtype": "I32"}  # F32 bytes as I32
        shifted = json.loads(json.dumps(header))
        for k, v in shifted.items():
            if k != "__metadata__":
                v["data_offsets"] = [o + 64 for o in v["data_offsets"]]
        for case, h in (("I32 labels", labels), ("shifted", shifted)):
            os.makedirs(os.path.join(root, case))
            _write_raw(os.path.join(root, case, "model.safetensors"), h, data)
            cases[case] = os.path.join(root, case, "model.safetensors")
    box = [cases]
    torch.distributed.broadcast_object_list(box)
    cases = box[0]
    before_files = digests(root)
    before = full_state_dict(engine.module)
    out = {}
    for case, file in cases.items():
        try:
            load_hf_checkpoint(engine, os.path.dirname(file))
            out[case] = None
        except ValueError as err:
            out[case] = str(err)
    after = full_state_dict(engine.module)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    torch.distributed.barrier()
    return out, cases, unchanged, before_files == digests(root)


def test_hf_load_refuses_bytes_the_parameter_cannot_take(pools):
    root = scratch_dir()
    try:
        results = pools(2).run(hf_bad_bytes, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert results[0][0] == results[1][0]  # every rank: the same line
    out, cases, unchanged, files_unchanged = results[0]
    assert out["I32 labels"] == (f"load_hf_checkpoint {os.path.dirname(cases['I32 labels'])}: "
                                 f"dtype mismatch: wte.weight (I32 in {cases['I32 labels']}, "
                                 "model float32)")
    assert out["shifted"].startswith(cases["shifted"] + ": tensor ")
    assert all(m and "\n" not in m for m in out.values()), out
    assert unchanged and files_unchanged


def hf_full_disk(rank, world, root):
    """A Hugging Face save meeting a full disk at its second file, then one with space."""
    from vescale_engine.checkpoint import CheckpointWriteError
    engine = make_engine(world)
    engine.save_hf_checkpoint(root, dtype="fp32", max_shard_size="20KB")  # the earlier save
    torch.distributed.barrier()
    before = digests(root)
    train(engine, rank, world, 1)
    started = time.monotonic()
    try:
        with disk_full(".model-00002.partial") if rank == 0 else contextlib.nullcontext():
            engine.save_hf_checkpoint(root, dtype="fp32", max_shard_size="20KB")
        message = None
    except CheckpointWriteError as err:
        message = str(err)
    seconds = time.monotonic() - started
    torch.distributed.barrier()
    unchanged = digests(root) == before
    try:  # one file, written at the end: the earlier save kept all the same
        with disk_full(".model-00001.partial") if rank == 0 else contextlib.nullcontext():
            engine.save_hf_checkpoint(root, dtype="fp32")
        last = None
    except CheckpointWriteError as err:
        last = str(err)
    torch.distributed.barrier()
    unchanged = unchanged and last is not None and digests(root) == before
    torch.distributed.barrier()  # every rank read the files before the next save replaces them
    engine.save_hf_checkpoint(root, dtype="fp32", max_shard_size="20KB")
    return message, seconds, unchanged, len(before)


def test_hf_save_on_a_full_disk_is_one_line_and_keeps_the_earlier_save(pools):
    root = scratch_dir()
    try:
        results = pools(2).run(hf_full_disk, root)
        names = sorted(os.listdir(root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert results[0][0] == results[1][0]
    message, seconds, unchanged, files = results[0]
    partial = os.path.join(root, ".model-00002.partial")
    assert message is not None and re.fullmatch(
        rf"save_hf_checkpoint: cannot write {re.escape(partial)}: No space left on device: its "
        r"tensor data needs \d+ bytes, \d+ bytes are free there \(nothing was replaced\)",
        message), message
    assert seconds < FAIL_WITHIN_S, seconds
    assert unchanged and files > 2  # index and every shard of the earlier save as they were
    assert not [n for n in names if n.startswith(".")], names  # the next save: nothing left


# -- vescale checkpoints: damaged vescale_state.json and latest ------------------------------------

def save_two(rank, world, root):
    engine = make_engine(world)
    train(engine, rank, world, 1)
    engine.save_checkpoint(root)              # global_step1
    train(engine, rank, world, 1)
    engine.save_checkpoint(root)              # global_step2, latest
    return train(engine, rank, world, 2)


@pytest.fixture(scope="module")
def saved(pools):
    root = scratch_dir()
    losses = pools(2).run(save_two, root)[0]
    yield root, losses
    shutil.rmtree(root, ignore_errors=True)


def _bump_digit(text, pattern):
    """`text` with the first significant digit of the first match of `pattern` (a number)
    changed (a last digit may name the same float)."""
    match = re.search(pattern, text)
    assert match, pattern
    number = match.group(1)
    i = min(i for i, ch in enumerate(number) if ch in "123456789")
    changed = number[:i] + str((int(number[i]) + 1) % 10) + number[i + 1:]
    return text[:match.start(1)] + changed + text[match.end(1):]


def _damaged_copies(good_root, scratch) -> dict:
    """{case: (directory to load, file that must be named)}; each a copy with one fault."""
    cases = {}

    def copy(name):
        target = os.path.join(scratch, name)
        shutil.copytree(good_root, target)
        return target

    for case, pattern in (("lr digit", r'"lr": ([0-9.e-]+)'),
                          ("betas digit", r'"betas": \[\s*([0-9.e-]+)'),
                          ("global_steps digit", r'"global_steps": ([0-9]+)')):
        root = copy(case)
        state = os.path.join(root, "global_step2", "vescale_state.json")
        with open(state) as f:
            text = f.read()
        with open(state, "w") as f:
            f.write(_bump_digit(text, pattern))
        cases[case] = (root, state)
    root = copy("state not JSON")
    state = os.path.join(root, "global_step2", "vescale_state.json")
    with open(state, "r+b") as f:
        f.truncate(os.path.getsize(state) // 2)
    cases["state not JSON"] = (root, state)
    for case, content in (("latest random bytes", random.Random(23).randbytes(64)),
                          ("latest names the other tag", None),
                          ("latest checksum digit", None),
                          ("latest names a missing tag", None),
                          ("latest empty", b"")):
        root = copy(case)
        latest = os.path.join(root, "latest")
        if content is None:
            with open(latest) as f:
                text = f.read()
            if case == "latest names the other tag":  # global_step1 exists and is complete
                content = text.replace("global_step2", "global_step1").encode()
            elif case == "latest checksum digit":  # its sibling: latest.crc32
                latest = os.path.join(root, "latest.crc32")
                with open(latest) as f:
                    content = _bump_digit(f.read(), r"crc32:[0-9a-f]*?([0-9])").encode()
            else:
                shutil.rmtree(os.path.join(root, "global_step2"))
                content = text.encode()
        with open(latest, "wb") as f:
            f.write(content)
        cases[case] = (root, latest)
    cases["a file as the directory"] = (os.path.join(good_root, "latest"),) * 2
    state = os.path.join(good_root, "global_step2", "vescale_state.json")
    cases["a file as the tag"] = (state, state)
    return cases


def load_damaged(rank, world, cases):
    from vescale_engine.checkpoint import CheckpointError
    engine = make_engine(world)
    out = {}
    for case, (root, _) in sorted(cases.items()):
        try:
            engine.load_checkpoint(root)
            out[case] = None
        except (CheckpointError, FileNotFoundError) as err:
            out[case] = f"{type(err).__name__}: {err}"
    return out


def test_damaged_state_or_latest_is_one_line_naming_the_file(saved, pools):
    good_root, _ = saved
    scratch = scratch_dir()
    try:
        cases = _damaged_copies(good_root, scratch)
        before = {**digests(scratch), **{f"good/{k}": v for k, v in digests(good_root).items()}}
        results = pools(2).run(load_damaged, cases)
        after = {**digests(scratch), **{f"good/{k}": v for k, v in digests(good_root).items()}}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert results[0] == results[1]  # every rank raises the same line
    out = results[0]
    for case, (_, named) in cases.items():
        assert out[case] is not None, f"{case}: loaded"
        assert named in out[case] and "\n" not in out[case], (case, out[case])
    for case in ("lr digit", "betas digit", "global_steps digit"):
        assert out[case].endswith("vescale_state.json is corrupted: its values do not match its "
                                  "state_crc32 (edited or damaged after it was saved)"), out[case]
    assert "is corrupted: not JSON" in out["state not JSON"]
    assert out["latest random bytes"].endswith("latest is corrupted: not text")
    for case in ("latest names the other tag", "latest checksum digit"):
        assert "latest.crc32 does not vouch for (damaged, or edited by hand: then remove " \
            "latest.crc32 to load it unchecked)" in out[case], out[case]
    assert "latest names tag 'global_step2', but " in out["latest names a missing tag"]
    assert out["latest empty"].endswith("latest is empty")
    assert out["a file as the directory"].endswith("latest is a file, not a directory")
    assert "vescale_state.json is a file, not a directory" in out["a file as the tag"]
    assert after == before  # nothing was changed by the failed loads


# -- checkpoints written before checksums ---------------------------------------------------------

def load_and_train(rank, world, root):
    engine = make_engine(world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, _ = engine.load_checkpoint(root)
    about_checksums = sorted(str(w.message) for w in caught if "checksum" in str(w.message) or
                             "state_crc32" in str(w.message))
    return path, engine.global_steps, train(engine, rank, world, 2), about_checksums


def test_checkpoint_without_checksums_still_loads(saved, pools, tmp_path):
    """As the previous version wrote them: vescale_state.json without state_crc32 (json.dump,
    indent=1) and `latest` holding only the tag, without latest.crc32. They load, with a warning each, and continue
    exactly as the checksummed checkpoint does."""
    good_root, losses = saved
    old = tmp_path / "old"
    shutil.copytree(good_root, old)
    state_file = old / "global_step2" / "vescale_state.json"
    state = json.loads(state_file.read_text())
    del state["state_crc32"]
    state_file.write_text(json.dumps(state, indent=1))
    (old / "latest.crc32").unlink()  # DeepSpeed's `latest`, or a copy of the tag alone
    new_result, old_result = (pools(2).run(load_and_train, root) for root in (good_root, str(old)))
    path, steps, new_losses, messages = new_result[0]
    assert (path, steps, messages) == (os.path.join(good_root, "global_step2"), 2, [])
    assert max(abs(a - b) / b for a, b in zip(new_losses, losses)) < 1e-5, (new_losses, losses)
    path, steps, old_losses, messages = old_result[0]
    assert (path, steps, old_losses) == (str(old / "global_step2"), 2, new_losses)
    assert len(messages) == 2, messages
    assert any(m.endswith("latest has no checksum (written by an older version or by hand): "
                          "loading tag 'global_step2' unchecked") for m in messages), messages
    assert any("vescale_state.json has no state_crc32 (written by an older version)" in m
               for m in messages), messages


# -- a full disk while saving ---------------------------------------------------------------------

class _NoSpace:
    """A file being written on a full disk: every write raises ENOSPC (without a path, as
    the system's does)."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()
        return False

    def __getattr__(self, name):
        return getattr(self._file, name)


@contextlib.contextmanager
def disk_full(pattern):
    """In this process: files whose name matches `pattern` (fnmatch), opened for writing, get a
    full disk. Patches `builtins.open` and `io.open` (pathlib's, which DCP's writer uses)."""
    real_builtin, real_io = builtins.open, io.open

    def full_open(file, mode="r", *args, **kwargs):
        handle = real_io(file, mode, *args, **kwargs)
        name = os.path.basename(os.fspath(file)) if isinstance(file, (str, os.PathLike)) else ""
        if any(c in mode for c in "wax+") and fnmatch.fnmatch(name, pattern):
            return _NoSpace(handle)
        return handle

    builtins.open = io.open = full_open
    try:
        yield
    finally:
        builtins.open, io.open = real_builtin, real_io


def full_disk_saves(rank, world, root):
    """Saves that meet a full disk at each file a save writes, then one that succeeds."""
    from vescale_engine.checkpoint import CheckpointWriteError
    engine = make_engine(world)
    train(engine, rank, world, 1)
    engine.save_checkpoint(root)  # global_step1: the complete checkpoint to keep
    train(engine, rank, world, 1)
    out = {}
    faults = [("rank 1's data file", 1, "__1_*.distcp", "global_step2"),
              ("rank 0's data file", 0, "__0_*.distcp", "global_step2"),
              ("DCP's .metadata", 0, ".metadata*", "global_step2"),
              ("vescale_state.json", 0, ".vescale_state.json.tmp", "global_step2"),
              ("latest", 0, ".latest.tmp", "global_step2"),
              ("re-saving a tag", 1, "__1_*.distcp", "global_step1")]
    for case, failing_rank, pattern, tag in faults:
        torch.distributed.barrier()
        before = digests(root) if rank == 0 else None
        started = time.monotonic()
        try:
            with disk_full(pattern) if rank == failing_rank else contextlib.nullcontext():
                engine.save_checkpoint(root, tag=tag)
            message = None
        except CheckpointWriteError as err:
            message = (err.errno, str(err))
        seconds = time.monotonic() - started
        torch.distributed.barrier()
        after = digests(root) if rank == 0 else None
        if rank == 0 and case == "latest":  # the new checkpoint is complete: only it was added
            after = {k: v for k, v in after.items() if not k.startswith("global_step2/")}
        out[case] = dict(message=message, seconds=seconds, unchanged=before == after,
                         left=leftovers(root) if rank == 0 else None)
    # an interrupted save under another tag left its .partial: the next save removes it
    if rank == 0:
        os.makedirs(os.path.join(root, ".global_step9.partial"))
        with open(os.path.join(root, ".global_step9.partial", "__0_0.distcp"), "wb") as f:
            f.write(bytes(1024))
    torch.distributed.barrier()
    path = engine.save_checkpoint(root)  # global_step2, for real
    with open(os.path.join(root, "latest")) as f:
        latest = f.read().splitlines()[0]
    out["next save"] = dict(path=path, latest=latest, left=leftovers(root))
    fresh = make_engine(world)
    out["loaded"] = fresh.load_checkpoint(root)[0], fresh.global_steps
    return out


def test_full_disk_during_save_is_one_line_and_damages_nothing(pools, tmp_path):
    root = str(tmp_path / "ckpt")
    results = pools(2).run(full_disk_saves, root)
    out = results[0]
    for case in out:
        if "message" in out[case]:
            assert results[1][case]["message"] == out[case]["message"], case  # same line
    partial = os.path.join(root, ".global_step2.partial")
    for case, rank, file in (("rank 1's data file", 1, "__1_0.distcp"),
                             ("rank 0's data file", 0, "__0_0.distcp"),
                             ("DCP's .metadata", 0, ".metadata.tmp")):
        code, message = out[case]["message"]
        assert code == errno.ENOSPC and "\n" not in message
        assert re.fullmatch(
            rf"save_checkpoint: cannot write {re.escape(os.path.join(partial, file))} \(rank "
            rf"{rank}\): No space left on device: the checkpoint's tensor data needs \d+ bytes, "
            r"\d+ bytes are free there \(nothing was published\)", message), (case, message)
    code, message = out["vescale_state.json"]["message"]
    assert code == errno.ENOSPC and re.fullmatch(
        rf"save_checkpoint: cannot write {re.escape(os.path.join(partial, 'vescale_state.json'))}"
        r": No space left on device: it needs \d+ bytes, \d+ bytes are free there \(nothing was "
        r"published\)", message), message
    code, message = out["latest"]["message"]
    latest = os.path.join(root, "latest")
    assert code == errno.ENOSPC and re.fullmatch(
        rf"save_checkpoint: {re.escape(os.path.join(root, 'global_step2'))} is complete, but "
        rf"{re.escape(latest)} still names the previous checkpoint: cannot write "
        rf"{re.escape(latest)}: No space left on device: it needs 12 bytes, \d+ bytes are free "
        "there", message), message
    code, message = out["re-saving a tag"]["message"]
    assert os.path.join(root, ".global_step1.partial", "__1_0.distcp") in message
    for case, seen in out.items():
        if "message" in seen:
            assert seen["unchanged"], f"{case}: files changed"
            assert seen["left"] == [], (case, seen["left"])
            assert seen["seconds"] < FAIL_WITHIN_S, (case, seen["seconds"])
    assert out["next save"] == dict(path=os.path.join(root, "global_step2"),
                                    latest="global_step2", left=[])
    assert out["loaded"] == (os.path.join(root, "global_step2"), 2)
    print({case: round(seen["seconds"], 2) for case, seen in out.items() if "seconds" in seen})

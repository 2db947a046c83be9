"""Compare two saved safetensors files (DeepSpeed's, ours) tensor by tensor:

    python weights_diff.py DEEPSPEED.safetensors OURS.safetensors INITIAL.safetensors

Prints one JSON line: "weights", the largest over tensors of max|ours - ds| / max|ds|, the
tensor where it is, and, where INITIAL holds the same names (a full fine-tune), "update", the
same of the updates (saved - initial), which the first hides when training moved the weights
little, with "update_rounding", one fp32 rounding of that tensor's weights relative to its
update (the level below which two updates cannot be told apart). Names or shapes that differ
are an error."""
import json
import sys

import torch
from safetensors.torch import load_file


def main(ds_path, ours_path, init_path):
    ds, ours, init = load_file(ds_path), load_file(ours_path), load_file(init_path)
    if set(ds) != set(ours):
        raise SystemExit(f"weights_diff: names differ: {sorted(set(ds) ^ set(ours))[:6]}")
    out = {"weights": 0.0, "weights_at": None}
    full = set(ds) <= set(init)
    if full:
        out.update(update=0.0, update_at=None)
    for name in sorted(ds):
        a, b = ds[name].double(), ours[name].double()
        if a.shape != b.shape:
            raise SystemExit(f"weights_diff: {name}: shapes {tuple(a.shape)} {tuple(b.shape)}")
        r = ((b - a).abs().max() / a.abs().max().clamp_min(1e-30)).item()
        if r >= out["weights"]:
            out["weights"], out["weights_at"] = r, name
        if full:
            da, db = a - init[name].double(), b - init[name].double()
            r = ((db - da).abs().max() / da.abs().max().clamp_min(1e-30)).item()
            if r >= out["update"]:
                out["update"], out["update_at"] = r, name
                # One fp32 rounding of the weights, relative to this tensor's update: a
                # difference of the updates at this level is rounding, not training.
                out["update_rounding"] = (torch.finfo(torch.float32).eps * a.abs().max()
                                          / da.abs().max().clamp_min(1e-30)).item()
    out["tensors"] = len(ds)
    print(json.dumps(out))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:4])

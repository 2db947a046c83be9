"""`vescale consolidate` and `vescale convert-zero`: checkpoint tools that need no process group."""
from __future__ import annotations

import os


def add_parsers(sub):
    p = sub.add_parser("consolidate", help="write a checkpoint as one full state dict",
                       description="Gather a vescale checkpoint (a save dir with `latest`, or a "
                                   "tag dir) into one unsharded state dict that a plain "
                                   "model.load_state_dict accepts.")
    p.add_argument("checkpoint", metavar="CKPT_DIR")
    p.add_argument("out", metavar="OUT", help="output file: .pt (or .pth/.bin) or .safetensors")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="floating tensors are written in this dtype (default fp32)")
    p.set_defaults(run=_run_consolidate)

    p = sub.add_parser("convert-zero", help="import a DeepSpeed ZeRO checkpoint",
                       description="Convert a DeepSpeed ZeRO-1/2/3 checkpoint (weights and Adam "
                                   "moments) into a vescale checkpoint that loads at any world "
                                   "size.")
    p.add_argument("ds_checkpoint", metavar="DS_CKPT_DIR",
                   help="DeepSpeed save dir (with `latest`) or one of its tag dirs")
    p.add_argument("out", metavar="OUT_DIR", help="vescale save dir (the tag is kept)")
    p.add_argument("--tag", default=None, help="DeepSpeed tag to convert (default: latest)")
    p.set_defaults(run=_run_convert_zero)


def _run_consolidate(args) -> int:
    import torch
    from vescale_engine.checkpoint import consolidate
    full = consolidate(args.checkpoint, args.out,
                       dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    print(f"{args.out}: {len(full)} tensors, {sum(v.numel() for v in full.values())} elements, "
          f"{os.path.getsize(args.out)} bytes")
    return 0


def _run_convert_zero(args) -> int:
    from vescale_engine.checkpoint.zero import convert_zero
    path = convert_zero(args.ds_checkpoint, args.out, tag=args.tag)
    print(f"{path}: converted from {args.ds_checkpoint}")
    return 0

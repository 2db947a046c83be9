"""`python -m vescale_engine.fake_world`: one recorded step (record.record_step) in a fresh
process, as `vescale plan --time --fake-world` runs it: reads {"shapes": path, "setup":
{Setup's fields}, "system": "ours" | "fsdp2"} on stdin, writes the record as JSON on stdout;
bad input: one line on stderr, exit status 2."""
import json
import sys

from ..plan.capacity import Setup
from ..plan.model_plan import load_shapes
from .record import record_step


def main() -> int:
    case = json.load(sys.stdin)
    try:
        model = load_shapes(case["shapes"])
        setup = Setup(**{k: tuple(v) if isinstance(v, list) else v
                         for k, v in case["setup"].items()})
        record = record_step(model, setup, case["system"])
    except (ValueError, OSError) as err:   # a ShapesError is a ValueError
        print(f"fake world: {err}", file=sys.stderr)
        return 2
    json.dump(record, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``paged-attention`` command line (also ``python -m paged_attention_ext``).

Every subcommand accepts ``--json``: the last line printed is then one JSON object.
"""

import argparse
import json
import sys
from typing import Callable, Dict, List, Optional

from . import walkthrough

Command = Callable[[argparse.Namespace], Dict]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-attention", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run every op on a small paged cache and check it "
                                       "against the reference implementation")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=walkthrough.run)
    for child in sub.choices.values():
        child.add_argument("--json", action="store_true", help="end with one JSON object")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    report = args.run(args)
    if args.json:
        print(json.dumps(report))
    return 0 if report.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())

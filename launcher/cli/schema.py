"""`accum-sched schema`: print the JSON Schema of config files (for editors: completion and checks while typing).
Never imports torch."""
from __future__ import annotations

import json
import os

from launcher.config.json_schema import config_schema
from launcher.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of config files (point your editor at it)")
    p.add_argument("--output", "-o", default=None, metavar="FILE",
                   help="write it to FILE instead of printing it (e.g. accum-sched.schema.json)")
    p.set_defaults(func=main)


def main(args) -> int:
    text = json.dumps(config_schema(), indent=2) + "\n"
    if args.output is None:
        print(text, end="")
        return 0
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise ConfigError("--output", f"the folder {folder} does not exist", "create it, or give another path")
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.output}: add '# yaml-language-server: $schema={args.output}' as the first line of a config")
    return 0

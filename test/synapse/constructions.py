"""Sum what the shim (shim/sitecustomize.py) recorded in every process of a
scripts/synapse-tests run: which class each module constructed, per stream.

    python test/synapse/constructions.py --mode MODE COUNTS_DIR

Fails (exit 1) in modes streampos and class if a module of Synapse
(synapse.*) constructed Synapse's own MultiWriterIdGenerator, or if nothing
constructed the replacement.
"""

import argparse
import collections
import glob
import json
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("counts")
    args = parser.parse_args()
    by_key = collections.Counter()
    files = glob.glob(os.path.join(args.counts, "constructions-*.json"))
    for path in files:
        with open(path) as f:
            by_key.update(json.load(f))
    by_class_module = collections.defaultdict(collections.Counter)
    streams = collections.defaultdict(set)
    for key, n in by_key.items():
        cls, module, stream = key.split(" ", 2)
        by_class_module[cls][module] += n
        streams[(cls, module)].add(stream)
    print(f"generator constructions ({len(files)} processes):")
    for cls in sorted(by_class_module):
        total = sum(by_class_module[cls].values())
        print(f"  {cls}: {total}")
        for module, n in sorted(by_class_module[cls].items()):
            names = ", ".join(sorted(streams[(cls, module)]))
            print(f"    {n:6d}  {module}  [{names}]")
    if args.mode in ("streampos", "class"):
        stock_in_synapse = {
            m: n for m, n in by_class_module.get("MultiWriterIdGenerator", {}).items() if m.startswith("synapse.")
        }
        if stock_in_synapse:
            print(f"FAILED: Synapse's own class constructed by {sorted(stock_in_synapse)}")
            return 1
        if not by_class_module.get("StreamposIdGenerator"):
            print("FAILED: no StreamposIdGenerator was constructed")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a profile's samples of the drafts went: `py-spy record --native --format raw` output
of `probes/probe_spec_phases.py --chain-only`, read for the samples inside its `chain` (the drafts, not the
imports and the load), each frame's share inclusive and exclusive.

    python3 profile_summary.py RAW [TOP]
"""

import collections
import re
import sys


def main() -> None:
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in open(sys.argv[1]):
        stack, _, n = line.rstrip().rpartition(" ")
        if "chain (" not in stack:
            continue
        frames = stack.split(";")
        at = max(i for i, f in enumerate(frames) if f.startswith("chain ("))
        # addresses without symbols fold by library
        frames = [re.sub(r"0x[0-9a-f]+ ", "0x ", f) for f in frames[at:]]
        total += int(n)
        own[frames[-1]] += int(n)
        for f in set(frames):
            inclusive[f] += int(n)
    print(f"{total} samples in the drafts")
    for title, counts in (("inclusive", inclusive), ("exclusive", own)):
        print(f"-- {title}")
        for f, n in counts.most_common(top):
            print(f"{100 * n / total:5.1f}%  {f[:140]}")


if __name__ == "__main__":
    main()

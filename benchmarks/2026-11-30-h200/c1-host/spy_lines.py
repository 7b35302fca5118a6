"""py-spy's raw output (`record -f raw`) summed by line: the samples of the threads whose name
holds THREAD, by their deepest trio_mlx frame (`tm`), their leaf frame (`leaf`), both (`leafpy`),
or, for the samples under a frame holding ANCHOR (`under:ANCHOR`, e.g. `under:_decode.py:440`), by
the first MLX primitive, commit, event or detach below it (native samples).

    python spy_lines.py FILE [THREAD] [tm|leaf|leafpy|under:ANCHOR] [TOP]
"""
import collections
import sys

path = sys.argv[1]
thread = sys.argv[2] if len(sys.argv) > 2 else ""
mode = sys.argv[3] if len(sys.argv) > 3 else "leafpy"
top = int(sys.argv[4]) if len(sys.argv) > 4 else 25
by_line: collections.Counter[str] = collections.Counter()
threads: collections.Counter[str] = collections.Counter()
selected = 0
for raw in open(path):
    raw = raw.rstrip("\n")
    if not raw:
        continue
    stack, count = raw.rsplit(" ", 1)
    frames = stack.split(";")
    threads[frames[0][:90]] += int(count)
    if thread not in frames[0]:
        continue
    rest = frames[1:]
    if mode.startswith("under:"):
        at = [i for i, f in enumerate(rest) if mode[6:] in f]
        if not at:
            continue
        rest = rest[at[-1] + 1:]
        marks = ("eval_gpu", "commit", "detach", "Event::", "Fence")
        first = [f.split(" (")[0] for f in rest if any(m in f for m in marks)]
        named = [f.split(" (")[0] for f in rest if not f.startswith("0x")]
        key = first[0] if first else (named[-1] + " (itself)" if named else "-")
        by_line[key] += int(count)
        selected += int(count)
        continue
    selected += int(count)
    ours = [f for f in rest if "trio_mlx" in f]
    leaf = rest[-1] if rest else "-"
    if mode == "tm":
        key = ours[-1] if ours else leaf
    elif mode == "leaf":
        key = leaf
    else:
        key = (ours[-1] if ours else "-") + " || " + leaf
    by_line[key] += int(count)
print("threads:")
for name, n in threads.most_common(8):
    print(f"  {n:6d} {name}")
print("selected", selected)
for key, n in by_line.most_common(top):
    print(f"{n:6d} {100 * n / max(selected, 1):5.1f}% {key[:260]}")

"""Probe (GPU investigation): does what runs beside the actor slow a decode step?

    python benchmarks/probes/probe_host.py MODEL_DIR [ROUNDS]

Times `BatchGenerator.next()` at batch 1 and 8 (median ms of 200 decode steps)
under host conditions, interleaved round by round so the host's drift weighs
on all alike: alone; beside busy pure-Python loops; beside two "event loops"
(0.5 ms of work every 4 ms, about what the server and a client do per token
at c=1); pinned to one CPU, alone and with the neighbours pinned elsewhere;
and in a child process started the way the server starts its actor. Prints
one JSON line per measurement and a summary; also the stepping process's CPU
seconds per wall second (does waiting on the GPU spin?). The server's actor
trace showed its `next()` ~1 ms slower at c=1 than the bench's ceiling
(benchmarks/2026-11-22-h100/stream-ends/README.md); this asks whether the host is why.
"""

import json
import os
import random
import statistics
import subprocess
import sys
import time

CHILD = "--child"


def load(path):
    from mlx_lm.generate import BatchGenerator

    from trio_mlx.models import load_model

    model, config = load_model(path)
    vocab = int(config["vocab_size"])
    bg = BatchGenerator(model, max_tokens=10**6, completion_batch_size=256, prefill_batch_size=8,
                        prefill_step_size=2048)
    rng = random.Random(0)

    def prompts(k):
        return [[rng.randrange(10, vocab) for _ in range(128)] for _ in range(k)]

    for c in (1, 8, 1, 8):  # warm-up: every shape used below, twice
        measure(bg, prompts, c, 20)
    return bg, prompts


def measure(bg, prompts, c, steps):
    clock = time.perf_counter
    uids = bg.insert(prompts(c), max_tokens=[10**6] * c)
    for _ in range(1000):
        _, gen = bg.next()
        if len(gen) == c:
            break
    times = []
    cpu0, w0 = time.process_time(), clock()
    for _ in range(steps):
        t = clock()
        bg.next()
        times.append(clock() - t)
    cpu = (time.process_time() - cpu0) / (clock() - w0)
    bg.remove(uids)
    return statistics.median(times) * 1e3, cpu


SPIN = "while True: pass"
LOOP = ("import time\nwhile True:\n t = time.perf_counter()\n"
        " while time.perf_counter() - t < 0.0005: pass\n time.sleep(0.0035)")


def neighbours(code, n, cpus=None):
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    if cpus:
        for p in procs:
            os.sched_setaffinity(p.pid, cpus)
    time.sleep(0.2)
    return procs


def stop(procs):
    for p in procs:
        p.kill()
        p.wait()


def siblings(cpu):
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return {cpu}
    out = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def child(path, rounds):
    bg, prompts = load(path)
    for r in range(rounds):
        for c in (1, 8):
            ms, cpu = measure(bg, prompts, c, 200)
            print(json.dumps({"round": r, "cond": "child process", "c": c, "ms": ms, "cpu": cpu}), flush=True)


def main():
    if sys.argv[1] == CHILD:
        child(sys.argv[2], int(sys.argv[3]))
        return
    path = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    allcpus = os.sched_getaffinity(0)
    print(json.dumps({"cpus": len(allcpus), "cpu0_siblings": sorted(siblings(0)),
                      "loadavg": os.getloadavg()}), flush=True)
    bg, prompts = load(path)
    pin = max(allcpus)
    away = allcpus - siblings(pin) or allcpus
    results = []

    def run(cond, r, setup=None, teardown=None):
        procs = setup() if setup else []
        try:
            for c in (1, 8):
                ms, cpu = measure(bg, prompts, c, 200)
                row = {"round": r, "cond": cond, "c": c, "ms": ms, "cpu": cpu}
                results.append(row)
                print(json.dumps(row), flush=True)
        finally:
            stop(procs)
            if teardown:
                teardown()

    def unpin():
        os.sched_setaffinity(0, allcpus)

    for r in range(rounds):
        run("alone", r)
        run("1 busy loop", r, lambda: neighbours(SPIN, 1))
        run(f"{len(allcpus)} busy loops", r, lambda: neighbours(SPIN, len(allcpus)))
        run("2 event loops", r, lambda: neighbours(LOOP, 2))
        run("pinned", r, lambda: (os.sched_setaffinity(0, {pin}), [])[1], unpin)
        run("pinned, 2 event loops elsewhere", r,
            lambda: (os.sched_setaffinity(0, {pin}), neighbours(LOOP, 2, away))[1], unpin)
        run("pinned, busy loops elsewhere", r,
            lambda: (os.sched_setaffinity(0, {pin}), neighbours(SPIN, len(away), away))[1], unpin)
    # the same steps in a child process started as the server starts its actor
    out = subprocess.run([sys.executable, __file__, CHILD, path, str(rounds)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, check=True, text=True).stdout
    for line in out.splitlines():
        results.append(json.loads(line))
        print(line, flush=True)
    print("\nmedian over rounds (ms per next(), CPU s per wall s):")
    conds = list(dict.fromkeys(r["cond"] for r in results))
    for cond in conds:
        cells = []
        for c in (1, 8):
            rows = [x for x in results if x["cond"] == cond and x["c"] == c]
            cells.append(f"c={c}: {statistics.median(x['ms'] for x in rows):6.2f} ms "
                         f"(min {min(x['ms'] for x in rows):5.2f}) cpu {statistics.median(x['cpu'] for x in rows):.2f}")
        print(f"  {cond:34s} " + "   ".join(cells))


if __name__ == "__main__":
    main()

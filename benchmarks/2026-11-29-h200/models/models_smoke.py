"""GPU smoke of --models: two models on the one actor thread, requests to both at once."""
import json, subprocess, sys, time, re, os, threading
import httpx, trio

port = 8011
proc = subprocess.Popen([sys.executable, "-m", "trio_mlx.cli", "serve", "--models", os.environ.get("MM_DIR", "/tmp/mm"), "--max-loaded-models", "2",
                         "--port", str(port), "--no-access-log"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
up = threading.Event(); lines = []
def pump():
    for raw in proc.stderr:
        line = raw.decode(errors="replace"); lines.append(line)
        if "Running on" in line: up.set()
threading.Thread(target=pump, daemon=True).start()
assert up.wait(200), "".join(lines[-30:])
base = f"http://127.0.0.1:{port}"

async def one(c, model, res):
    t0 = time.perf_counter(); first = None; n = 0
    async with c.stream("POST", "/v1/completions", json={"model": model, "prompt": "hello " * 60, "max_tokens": 128,
                        "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                if d.get("usage"):
                    n = d["usage"]["completion_tokens"]
                elif first is None:
                    first = time.perf_counter()
        res.append((model, r.status_code, n, (n - 1) / (time.perf_counter() - first) if first and n > 1 else 0,
                    (first or t0) - t0))

async def main():
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        for label, plan in (("a alone (loads a)", ["a"]), ("b alone (loads b)", ["b"]), ("a x4", ["a"] * 4),
                            ("a x4 + b x4", ["a", "b"] * 4), ("a x1 + b x1", ["a", "b"]), ("a x1", ["a"])):
            res = []; t0 = time.perf_counter()
            async with trio.open_nursery() as n:
                for m in plan:
                    n.start_soon(one, c, m, res)
            wall = time.perf_counter() - t0
            per = {m: [round(x[3]) for x in res if x[0] == m] for m in set(plan)}
            print(label, "wall %.2f s" % wall, "statuses", sorted({x[1] for x in res}), "chunks", sorted({x[2] for x in res}),
                  "decode tok/s per request", per, "ttft max %.2f" % max(x[4] for x in res), flush=True)
        print("models", [(m["id"], m.get("state")) for m in (await c.get("/v1/models")).json()["data"]], flush=True)
trio.run(main)
proc.terminate(); print("exit", proc.wait(60))
print("".join(l for l in lines if "actor host" in l or "ERROR" in l or "Traceback" in l)[-3000:])

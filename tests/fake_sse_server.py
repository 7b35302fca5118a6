"""A stand-in OpenAI-compatible server in a process of its own, standard library only, for tests
that start servers (`trio-mlx bench compare`): it starts in a fraction of a second.

    python tests/fake_sse_server.py --port PORT [--tag TEXT] [--no-ready]

Streams `max_tokens` one-word chunks for /v1/completions and /v1/chat/completions, then a usage
chunk and `data: [DONE]`, FAKE_DELAY seconds (environment, default 0) between chunks; answers
`GET /ready` (404 with --no-ready, as mlx_lm.server does), `/health` and `/v1/models`. Prints
its tag, port and FAKE_DELAY first, for the test to find in its log.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tag", default="")
    p.add_argument("--no-ready", action="store_true")
    args = p.parse_args()
    delay = float(os.environ.get("FAKE_DELAY", "0"))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def _json(self, status: int, obj: object) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/ready" and not args.no_ready or self.path == "/health":
                self._json(200, {"status": "ready"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            chat = self.path == "/v1/chat/completions"
            if not chat and self.path != "/v1/completions":
                self._json(404, {"error": {"message": "not found"}})
                return
            n = int(body.get("max_tokens") or 16)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(n):
                choice = {"index": 0, "finish_reason": None,
                          **({"delta": {"content": " word"}} if chat else {"text": " word"})}
                self.wfile.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(delay)
            usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
            self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"fake server {args.tag} on {args.port}, FAKE_DELAY={delay}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

"""A stand-in OpenAI-compatible endpoint with scripted HTTP statuses: `python http_stub.py PORT MODE LOG`.

For the kit's handling of statuses a real vLLM answers only in states that are hard to produce on purpose
(a 4xx to the readiness probe, a refused request in the middle of an evaluation). Every completion
request's prompt is appended to LOG, so a test can check that nothing was asked twice.

MODE: ok | probe-404 (the completion route says the model does not exist) | refuse-BAD (a 400 for
prompts containing BAD) | loading (/health 503 forever).
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, MODE, LOG = int(sys.argv[1]), sys.argv[2], sys.argv[3]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._send(503 if MODE == "loading" else 200, {})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(LOG, "a") as f:
            f.write(json.dumps(req["prompt"]) + "\n")
        if MODE == "probe-404":
            self._send(
                404, {"error": {"message": f"The model `{req['model']}` does not exist.", "code": 404}}
            )
        elif MODE == "refuse-BAD" and "BAD" in req["prompt"]:
            self._send(400, {"error": {"message": "max_tokens is too large", "code": 400}})
        else:
            self._send(
                200,
                {
                    "choices": [{"text": f"answer to {req['prompt']}", "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4},
                },
            )


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()

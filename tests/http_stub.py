"""A stand-in OpenAI-compatible endpoint with scripted HTTP statuses: `python http_stub.py PORT MODE LOG`.

For the kit's handling of statuses a real vLLM answers only in states that are hard to produce on purpose
(a 4xx to the readiness probe, a refused request in the middle of an evaluation). Every completion
request's prompt is appended to LOG, so a test can check that nothing was asked twice.

MODE: ok | probe-404 (the completion route says the model does not exist) | refuse-BAD (a 400 for
prompts containing BAD) | loading (/health 503 forever) | key-SECRET (401 unless the bearer token is
SECRET). Chat completions (a judge) answer a judgment in HLE's JSON: correct when the response holds the
gold, confidence 70.
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

    def _refused_key(self) -> bool:
        if MODE.startswith("key-") and self.headers.get("Authorization") != f"Bearer {MODE[4:]}":
            self._send(401, {"error": {"message": "Unauthorized", "code": 401}})
            return True
        return False

    def do_GET(self):
        if self.path == "/health":
            self._send(503 if MODE == "loading" else 200, {})
        elif self.path == "/v1/models":
            if not self._refused_key():
                self._send(200, {"data": [{"id": "model"}, {"id": "judge"}]})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self._refused_key():
            return
        asked = req["messages"][-1]["content"] if "messages" in req else req["prompt"]
        with open(LOG, "a") as f:
            f.write(json.dumps(asked) + "\n")
        if "messages" in req:
            self._judge(asked)
        elif MODE == "probe-404":
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

    def _judge(self, prompt: str) -> None:
        if MODE == "refuse-BAD" and "BAD" in prompt:
            self._send(400, {"error": {"message": "prompt rejected", "code": 400}})
            return
        response = prompt.split("[response]: ", 1)[1].split("\n\nYour judgement", 1)[0]
        gold = prompt.split("[correct_answer]: ", 1)[1].split("\n", 1)[0]
        judgment = {
            "extracted_final_answer": response.strip().splitlines()[-1],
            "reasoning": "compared",
            "correct": "yes" if gold in response else "no",
            "confidence": 70,
        }
        self._send(
            200,
            {
                "choices": [{"message": {"content": json.dumps(judgment)}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 9},
            },
        )


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()

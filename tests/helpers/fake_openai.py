"""A deterministic stand-in for a drafting model behind the OpenAI-compatible interface.

`ScriptedModel(answer)` serves `POST /v1/chat/completions` on a loopback port; `answer(body)`
gets the request body and returns the assistant message (`{"content": ...}`, optionally with
`tool_calls`). Every request is kept in `.requests` so a test can check what the pipeline asked.
Real HTTP, so the pipelines' client code runs unchanged; only the model is scripted.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedModel:
    def __init__(self, answer):
        self.answer = answer
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        model = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with model._lock:
                    model.requests.append(body)
                    try:
                        message = model.answer(body)
                        status = 200
                    except Exception as exc:  # surfaces in the pipeline as an HTTP 500
                        message, status = {"content": f"script failed: {exc!r}"}, 500
                payload = json.dumps({"choices": [{"index": 0, "message": {
                    "role": "assistant", **message}, "finish_reason": "stop"}]}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self):
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


def json_message(value: dict) -> dict:
    return {"content": "Here is the task.\n```json\n" + json.dumps(value, indent=1) + "\n```"}

"""The drafting model: any OpenAI-compatible `/chat/completions` endpoint (`kiln serve`, a
rollout pod's `openaiPort`, vLLM's server, a hosted model).

Standard library only (urllib), so the pipelines need no client package. A connection error or
a 5xx/429 answer is retried with backoff (the server may be starting or busy); a 4xx answer is
not (the request is wrong: retrying will not help) and raises `DrafterError` at once. The API
key, when the endpoint needs one, comes from `KILN_MODEL_API_KEY` or `OPENAI_API_KEY`.
"""
from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request


class DrafterError(RuntimeError):
    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


class Drafter:
    def __init__(self, base_url: str, model: str = "default", timeout: float = 300.0,
                 retries: int = 4):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.timeout = timeout
        self.retries = retries
        self.api_key = os.environ.get("KILN_MODEL_API_KEY") or os.environ.get("OPENAI_API_KEY")

    def chat(self, messages: list[dict], tools: list[dict] | None = None, **sampling) -> dict:
        """The assistant message of one completion: `content` and, when the model called tools,
        `tool_calls` in the OpenAI shape."""
        body = {"model": self.model, "messages": messages, **sampling}
        if tools:
            body["tools"] = tools
        reply = self._post(body)
        try:
            return reply["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise DrafterError(f"{self.url}: answer has no choices[0].message: "
                               f"{json.dumps(reply)[:300]}", retryable=False) from None

    def complete(self, messages: list[dict], **sampling) -> str:
        return self.chat(messages, **sampling).get("content") or ""

    def _post(self, body: dict) -> dict:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        delay = 1.0
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.url, data=data, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:300].decode(errors="replace")
                if exc.code != 429 and exc.code < 500:
                    raise DrafterError(f"{self.url}: HTTP {exc.code}: {detail}",
                                       retryable=False) from None
                error = f"HTTP {exc.code}: {detail}"
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                error = str(getattr(exc, "reason", exc))
            except json.JSONDecodeError as exc:
                raise DrafterError(f"{self.url}: answer is not JSON ({exc.msg})",
                                   retryable=False) from None
            if attempt < self.retries:
                time.sleep(delay)
                delay = min(delay * 2, 30.0)
        raise DrafterError(f"{self.url}: no answer after {self.retries + 1} tries ({error})",
                           retryable=True)


_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)```", re.S)


def extract_json(text: str) -> dict:
    """The JSON object in a model's reply: a fenced ```json block, else the outermost braces.
    ValueError (with what was wrong) when there is none, so the caller can ask again."""
    candidates = [m.group(1) for m in _FENCE.finditer(text)]
    start, end = text.find("{"), text.rfind("}")
    if start != -1 and end > start:
        candidates.append(text[start:end + 1])
    error = "no JSON object in the reply"
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError as exc:
            error = f"the JSON does not parse: {exc.msg} at line {exc.lineno} column {exc.colno}"
            continue
        if isinstance(value, dict):
            return value
        error = "the JSON is not an object"
    raise ValueError(error)

"""The OpenAI batch file format: one request per input line, one result per output line.

    in:  {"custom_id": "q-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
    out: {"id": "batch_req_<hex>", "custom_id": "q-1",
          "response": {"status_code": 200, "request_id": "req_<hex>", "body": {...}}, "error": null}

A line the server would refuse, or that is not a batch line at all, is answered in the same
shape with its status code (400) and the server's error body; `error` stays null, as
OpenAI's own batch output has it for requests that reached the API. A line whose custom_id
cannot be read is answered with "custom_id": null.
"""

from __future__ import annotations

import json
import uuid

MAX_CUSTOM_ID_CHARS = 512  # OpenAI's own limit on custom_id


class LineError(ValueError):
    """The line is not a batch request; the message names the field ("url: ...")."""

    def __init__(self, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.custom_id = custom_id


def parse_line(text: str | None, urls: tuple[str, ...]) -> tuple[str, str, dict]:
    """(custom_id, url, body) of one input line (None: its bytes are not UTF-8); LineError
    when it is not a request."""
    if text is None:
        raise LineError("invalid JSON line: not UTF-8 text")
    try:
        line = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise LineError(f"invalid JSON line: {exc}") from None
    if not isinstance(line, dict):
        raise LineError("a batch line is a JSON object with custom_id, method, url and body")
    return parse_request(line, urls)


def parse_request(line: dict, urls: tuple[str, ...]) -> tuple[str, str, dict]:
    """(custom_id, url, body) of a line's fields; a `body` may also be given as JSON text."""
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineError(f"custom_id: required, a non-empty string of at most {MAX_CUSTOM_ID_CHARS} characters")
    method, url, body = line.get("method"), line.get("url"), line.get("body")
    if method != "POST":
        raise LineError(f"method: only POST is supported (got {_shown(method)})", custom_id)
    if url not in urls:
        raise LineError(f"url: expected one of {', '.join(urls)} (got {_shown(url)})", custom_id)
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise LineError(f"body: invalid JSON: {exc}", custom_id) from None
    if not isinstance(body, dict):
        raise LineError("body: required, the request body as a JSON object", custom_id)
    return custom_id, url, body


def output_line(custom_id: str | None, status_code: int, body_json: str) -> str:
    """One result line; `body_json` is the server's body, kept as it wrote it."""
    key = uuid.uuid4().hex
    return (
        f'{{"id":"batch_req_{key}","custom_id":{json.dumps(custom_id)},'
        f'"response":{{"status_code":{status_code},"request_id":"req_{key}","body":{body_json}}},"error":null}}'
    )


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 64 else text[:61] + "..."

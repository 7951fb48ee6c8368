"""Stopping the server as an operator does: SIGTERM (what systemd, Docker and a background
shell send) to `rayserve-paged serve` (`serve run` in its process) while a long stream runs.
The stream completes, Serve's shutdown lines appear, the command exits 0, with no stack
trace."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from .conftest import REPO
from .test_serve_run import _wait_healthy

pytestmark = pytest.mark.ray

NUM_TOKENS = 400  # a stream that is still running when the signal arrives


def _rayserve_paged_bin() -> str:
    return str(Path(sys.executable).with_name("rayserve-paged"))


def _stream(base: str, events: list, done: threading.Event, on_third_event=None) -> None:
    body = {"model": "tiny-opt", "prompt": "Hello", "max_tokens": NUM_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                    if len(events) == 3 and on_third_event is not None:
                        on_third_event()  # from the reader itself: the stream has not ended yet
    except httpx.HTTPError as exc:
        events.append(f"ERROR {exc!r}")
    finally:
        done.set()


def test_sigterm_drains_the_streams_in_flight_and_exits_0(ray_cluster, serve_port, tmp_path):
    config = (REPO / "configs" / "tiny.yaml").read_text().replace("port: 8000", f"port: {serve_port}")
    path = tmp_path / "tiny.yaml"
    path.write_text(config)
    output = tmp_path / "serve.log"
    env = dict(os.environ, RAY_ADDRESS=ray_cluster)
    with open(output, "w") as log:
        proc = subprocess.Popen(
            [_rayserve_paged_bin(), "serve", str(path)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            base = f"http://127.0.0.1:{serve_port}"
            _wait_healthy(base, proc)
            events: list[str] = []
            done, signalled = threading.Event(), threading.Event()

            def stop_the_server():  # while the stream is still being read: its end is yet to come
                proc.send_signal(signal.SIGTERM)
                signalled.set()

            threading.Thread(target=_stream, args=(base, events, done, stop_the_server), daemon=True).start()
            assert done.wait(180)
            assert signalled.is_set(), f"the stream ended in {len(events)} events, before the signal: it must be longer"
            assert proc.wait(timeout=120) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            from ray import serve

            serve.shutdown()  # the command shut Serve down: drop this process's client of it too
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all("error" not in chunk for chunk in chunks)
    assert [choice["finish_reason"] for c in chunks for choice in c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == NUM_TOKENS  # every token, none cut
    text = output.read_text()
    assert "Got SIGTERM: deleting ['llm']" in text and "Deleting app ['llm']" in text
    assert "Applications drained and deleted; shutting down Serve." in text
    assert "SIGTERM received" not in text and "Traceback" not in text
    # the loader's INFO line (load time, peak memory) reached the log at the default level
    assert re.search(
        r"SchedulerActor pid=\d+\).* loaded \S+ as torch.float32 on cpu in [\d.]+ s \(float weights; peak RSS", text
    )

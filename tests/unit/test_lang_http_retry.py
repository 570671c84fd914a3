"""bl.OpenAICompatible over a server that closes a kept-alive connection without answering the next request on it
(llama-server does after 5 s idle; CI once lost a run of tests/e2e/test_lang_llama_server.py to it): the call goes
again on a new connection, once, streamed or not; a server that keeps failing is still a typed error naming the
call."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

import banyan.lang as bl
from banyan.lang.errors import BackendUnavailableError


class DroppingHandler(http.server.BaseHTTPRequestHandler):
    """Answers /v1/models; a POST is answered only as the first request of its connection when `drop_reused` (a
    reused connection is closed unanswered), never when `drop_all`."""

    protocol_version = "HTTP/1.1"  # keep-alive
    drop_reused, drop_all = True, False
    posts: list[int] = []

    def setup(self):
        super().setup()
        self.requests_here = 0

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.requests_here += 1
        self._answer({"data": [{"id": "m", "owned_by": "someone"}]})

    def do_POST(self):
        self.requests_here += 1
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.posts.append(self.requests_here)
        if self.drop_all or (self.drop_reused and self.requests_here > 1):
            self.close_connection = True
            self.connection.shutdown(2)  # closed with nothing sent
            return
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        if not json.loads(body).get("stream"):
            self._answer({"choices": [{"text": "ok", "finish_reason": "stop", "index": 0}], "usage": usage})
            return
        chunks = [{"choices": [{"text": "ok", "finish_reason": None, "index": 0}]},
                  {"choices": [{"text": "", "finish_reason": "stop", "index": 0}], "usage": usage}]
        data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    DroppingHandler.posts = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), DroppingHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


def test_a_request_on_a_connection_the_server_closed_goes_again_on_a_new_one(server):
    backend = bl.OpenAICompatible(f"http://127.0.0.1:{server.server_port}/v1", api="completions", select_mode="logprobs")
    try:
        answer = backend.post("gen", f"{backend.api_base}/completions", {"model": "m", "prompt": "x"})
        assert answer["choices"][0]["text"] == "ok"
        assert DroppingHandler.posts == [2, 1]  # dropped on the reused connection, answered on a new one
    finally:
        backend.close()


def test_a_streamed_gen_on_a_connection_the_server_closed_goes_again_on_a_new_one(server):
    @bl.function
    def say(s):
        s += "Say: " + bl.gen("word", max_tokens=2)

    backend = bl.OpenAICompatible(f"http://127.0.0.1:{server.server_port}/v1", api="completions", select_mode="logprobs")
    try:
        state = say.run(backend=backend, stream=True)
        assert "".join(state.text_iter()) == "Say: ok" and state["word"] == "ok"
        assert state.error() is None
        assert DroppingHandler.posts == [2, 1]  # dropped before any chunk, streamed on a new connection
    finally:
        backend.close()


def test_a_server_that_keeps_dropping_is_a_typed_error_naming_the_call(server, monkeypatch):
    monkeypatch.setattr(DroppingHandler, "drop_all", True)
    backend = bl.OpenAICompatible(f"http://127.0.0.1:{server.server_port}/v1", api="completions", select_mode="logprobs")
    try:
        with pytest.raises(BackendUnavailableError, match="gen"):
            backend.post("gen", f"{backend.api_base}/completions", {"model": "m", "prompt": "x"})
        assert len(DroppingHandler.posts) == 2  # once more, not forever
    finally:
        backend.close()

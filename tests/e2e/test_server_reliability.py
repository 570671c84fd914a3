"""RELIABILITY.md against a real server: hostile input, disconnects, auth, tenants, load and faults.

Every bad request must get an OpenAI-shaped error with the right status, and leave the server
healthy with its KV pages back at baseline.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest

from banyan.config import ServerConfig
from banyan.server.app import build_app, is_admin_path
from banyan.server.playground import is_page_path
from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

COMMON = ("--served-model-name", "tiny", "--kv-cache-memory", "64MiB", "--max-model-len", "256")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_reliability")
    write_model_dir(path, "llama", seed=5)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    proc = start_server(model_dir, *COMMON)
    yield proc
    assert proc.stop() == 0, proc.log()


def post(server, path, body=None, content=None, headers=None, timeout=60):
    return httpx.post(f"{server.base_url}{path}", json=body, content=content, headers=headers, timeout=timeout)


def error_of(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:  # the field, or a place inside it ("stop[0]")
        assert error["param"] == param or error["param"].startswith((f"{param}[", f"{param}.")), error
    if code is not None:
        assert error["code"] == code, error
    return error


def metric(server, name) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith(f"banyan:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(server, timeout=10.0):
    """Until nothing runs and no KV page is held by a request."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "num_requests_running") == 0 and metric(server, "kv_cache_usage_perc") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not return to idle")


def health_latencies_while(server, future) -> list[float]:
    """Seconds each /health took, asked over and over until `future` is done (each must be 200).

    Asked at least once: a request that ends before the first probe still leaves one sample."""
    latencies = []
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        while True:
            start = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            if future.done():
                return latencies
            time.sleep(0.02)


def read_to_end(s: socket.socket) -> bytes:
    """Everything until the server hangs up (a socket timeout fails the test: it did not)."""
    chunks = []
    try:
        while chunk := s.recv(1 << 16):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def raw_post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


# -- C1: malformed HTTP / JSON ------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"{", b"\x00\xff garbage", b"", b"[]", b'"x"', b"1", b"null"])
def test_h1_h2_bodies_that_are_not_a_json_object(server, content):
    error_of(post(server, "/v1/completions", content=content, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize(
    "content,param",
    [
        (b'{"prompt": "x", "temperature": NaN}', "temperature"),
        (b'{"prompt": "x", "temperature": Infinity}', "temperature"),
        (b'{"prompt": "x", "temperature": 1e400}', "temperature"),
        (b'{"prompt": [5279552648203111001]}', None),
        (b'{"prompt": "x", "seed": 1180591620717411303424}', None),
    ],
)
def test_h7_numbers_out_of_range(server, content, param):
    error_of(post(server, "/v1/completions", content=content), 400, param=param)


def test_h6_deep_nesting(server):
    error_of(post(server, "/v1/completions", content=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400)


def test_h8_wrong_types_name_the_field(server):
    error_of(post(server, "/v1/completions", {"prompt": "x", "temperature": "hot"}), 400, param="temperature")
    error_of(post(server, "/v1/chat/completions", {"messages": {}}), 400, param="messages")


def test_h9_unknown_fields_are_ignored(server):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "no_such_field": {"a": 1}})
    assert r.status_code == 200


def test_h10_unknown_model(server):
    error_of(post(server, "/v1/completions", {"model": "gpt-17", "prompt": "x"}), 404, code="model_not_found")


def test_h11_wrong_method_is_405_and_says_which_are_allowed(server):
    r = httpx.get(f"{server.base_url}/v1/completions")
    error_of(r, 405)
    assert r.headers["allow"] == "POST"
    r = httpx.put(f"{server.base_url}/tokenize", json={"prompt": "x"})
    error_of(r, 405)
    assert r.headers["allow"] == "POST"


def test_h4_body_over_the_limit(server):
    big = b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}'
    error_of(post(server, "/v1/completions", content=big), 413)

    def chunks():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    error_of(post(server, "/v1/completions", content=chunks()), 413)  # chunked: no Content-Length


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def send_until_answered(port: int, head: bytes, filler: bytes, times: int) -> bytes:
    """Send head, then filler `times` times unless the server answers first; all it says until it hangs up."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(head)
            for _ in range(times):
                if select.select([s], [], [], 0)[0]:
                    break
                s.sendall(filler)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return read_to_end(s)


def test_h5_a_huge_header_or_countless_headers_are_refused_in_bounded_memory(server):
    before = rss_bytes(server.proc.pid)
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    huge = send_until_answered(server.port, head + b"X-Big: ", b"a" * (1 << 20), 64)  # one 64 MiB header
    countless = send_until_answered(server.port, head, b"".join(b"X-H%d: v\r\n" % i for i in range(10_000)), 1)
    for answer in (huge, countless):  # h11 stops at 64 KiB of head: an error, then the server hangs up
        assert answer == b"" or answer.split(b" ", 2)[1] in (b"400", b"431"), answer[:100]
    assert rss_bytes(server.proc.pid) - before < 16 << 20
    assert httpx.get(f"{server.base_url}/health").status_code == 200


@pytest.fixture(scope="module")
def impatient_server(model_dir):
    """Client deadlines of 2 s, 8 buffered stream events per choice, and a 512-token context for long streams."""
    proc = start_server(model_dir, *COMMON, "--max-model-len", "512", "--request-read-timeout", "2",
                        "--response-write-timeout", "2", "--max-buffered-events", "8")
    post(proc, "/v1/completions", {"prompt": "warm up", "max_tokens": 2})  # lazy first-request work out of the way
    yield proc
    assert proc.stop() == 0, proc.log()


def trickle(port: int, head: bytes, data: bytes) -> tuple[bytes, float]:
    """Send head, then data at 1 byte/s until the server answers or hangs up: (its answer, seconds)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        for byte in data:
            if select.select([s], [], [], 1.0)[0]:
                break
            s.send(bytes([byte]))
        return read_to_end(s), time.monotonic() - start


def test_h12_slowloris_is_cut_off_while_other_clients_are_served(impatient_server):
    server = impatient_server
    slow = {
        "silent": (b"", b""),
        "headers": (b"POST /v1/completions HTTP/1.1\r\n", b"X-Slow: " + b"a" * 60),
        "body": (raw_post("/v1/completions", b" " * 64)[:-64], b'{"prompt": ' + b" " * 50),
    }
    with ThreadPoolExecutor(len(slow)) as pool:
        futures = {name: pool.submit(trickle, server.port, *sent) for name, sent in slow.items()}
        served = pool.submit(post, server, "/v1/completions", {"prompt": "x", "max_tokens": 8})
        latencies = health_latencies_while(server, futures["body"])
    assert served.result().status_code == 200
    assert max(latencies) < 0.5, latencies
    for name, future in futures.items():
        answer, seconds = future.result()
        assert 1.5 < seconds < 6, (name, seconds)
        if name == "body":  # the handler had the request: the connection just closes
            assert answer == b""
        else:
            assert answer.startswith(b"HTTP/1.1 408 ") and b'"code": "request_timeout"' in answer, answer


# -- C2, C3: parameters and lengths -------------------------------------------------------------
@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": -1}, "n"),
        ({"prompt": "x", "n": 10**6}, "n"),
        ({"prompt": "x", "n": 2**63}, "n"),
        ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ({"prompt": "x", "best_of": 10**6}, "best_of"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "min_p": 2}, "min_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "stop": ["a" * (1 << 20)]}, "stop"),
        ({"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"prompt": ["x"] * 100_000}, "prompt"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "cache_salt": "bad salt!"}, "cache_salt"),
    ],
)
def test_c2_parameters_out_of_range(server, body, param):
    error_of(post(server, "/v1/completions", body), 400, param=param)


def test_c2_chat_top_logprobs(server):
    msgs = [{"role": "user", "content": "x"}]
    error_of(post(server, "/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 21}), 400,
             param="top_logprobs")


def test_t1_over_long_requests_again_and_again(server):
    ids = [5] * 250
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for _ in range(1000):
            r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 7})
            error_of(r, 400, code="context_length_exceeded")
    assert "256" in r.json()["error"]["message"] and "250" in r.json()["error"]["message"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_t2_the_boundary_passes(server):
    r = post(server, "/v1/completions", {"prompt": [5] * 255, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("prompt", [[-1], [384], [2**31], [2**63 - 1]])
def test_t3_token_ids_out_of_vocabulary(server, prompt):
    error_of(post(server, "/v1/completions", {"prompt": prompt}), 400, param="prompt")


@pytest.mark.parametrize("prompt", ["", [], [[]], [""]])
def test_t4_empty_prompts(server, prompt):
    error_of(post(server, "/v1/completions", {"prompt": prompt}), 400)


def test_l2_request_larger_than_the_context(server):
    error_of(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 10_000}), 400, code="context_length_exceeded")


@pytest.mark.parametrize("prompt", ["a" * 2_000_000, "a" + "\u0301" * 100_000], ids=["2MB-no-spaces", "100k-marks"])
def test_t5_pathological_text_ends_in_bounded_time_and_health_stays_fast(server, prompt):
    start = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(post, server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        latencies = health_latencies_while(server, future)
    assert future.result().status_code in (200, 400)
    assert time.monotonic() - start < ServerConfig.render_timeout + 5
    assert max(latencies) < 0.5, sorted(latencies)[-5:]


@pytest.mark.parametrize(
    "path,content,param",
    [
        ("/v1/completions", b'{"prompt": "\xff\xfe\xc3"}', None),
        ("/v1/completions", b'{"prompt": "ok \\ud800"}', "prompt"),
        ("/v1/completions", b'{"prompt": "ok", "\\udfff": 1}', None),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
    ],
)
def test_t6_invalid_utf8_and_lone_surrogates(server, path, content, param):
    error_of(post(server, path, content=content), 400, param=param)


def test_t6_a_stream_never_splits_a_multibyte_character(server, model_dir):
    from transformers import AutoTokenizer

    from banyan import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Byte-level BPE's single bytes C3, A9, B6: "é" is C3 A9 and "ö" is C3 B6, two tokens each.
    bias = {token: 100.0 for token in tokenizer.convert_tokens_to_ids(["Ã", "©", "¶"])}
    params = dict(temperature=0, max_tokens=48, ignore_eos=True)
    offline = LLM(str(model_dir), block_size=4, num_threads=1, max_model_len=256)
    ids = offline.generate(["x"], SamplingParams(**params, logit_bias=bias), use_tqdm=False)[0].outputs[0].token_ids
    expected = tokenizer.decode(ids)
    assert "é" in expected or "ö" in expected  # the model wrote some two-token characters
    body = {"prompt": "x", "stream": True, "logit_bias": {str(t): b for t, b in bias.items()}, **params}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected


def test_t7_prompt_embeds_are_refused_not_ignored(server):
    for body in ({"prompt": "x", "prompt_embeds": "AAAA"}, {"prompt_embeds": [[0.5, 1.0]]}):
        error = error_of(post(server, "/v1/completions", body), 400, param="prompt_embeds")
        assert "not supported" in error["message"]


# -- C5: chat templates and messages -------------------------------------------------------------
def test_m1_request_templates_are_refused(server):
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ cycler.__init__.__globals__ }}"}
    error_of(post(server, "/v1/chat/completions", body), 400, param="chat_template")


def test_m3_template_kwargs_cannot_override_internals(server):
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"add_generation_prompt": False}}
    error_of(post(server, "/v1/chat/completions", body), 400)


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "wizard", "content": "x"}], [{"role": "tool", "content": "x"}], [{"role": "user", "content": 5}]],
)
def test_m4_bad_messages(server, messages):
    error = error_of(post(server, "/v1/chat/completions", {"messages": messages}), 400)
    assert error["param"].startswith("messages")


# -- C6: disconnects -----------------------------------------------------------------------------
def test_d1_stream_disconnect_frees_the_pages(server):
    body = {"prompt": "tell me a long story", "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
    wait_idle(server, timeout=5)


def test_d2_non_stream_disconnect_aborts_too(server):
    before = metric(server, "generation_tokens_total")
    body = {"prompt": "tell me a long story", "max_tokens": 240, "ignore_eos": True}

    def leave_early():
        with pytest.raises(httpx.ReadTimeout):
            post(server, "/v1/completions", body, timeout=httpx.Timeout(5.0, read=0.03))  # long before 240 tokens

    threads = [threading.Thread(target=leave_early) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_idle(server, timeout=5)
    assert metric(server, "generation_tokens_total") - before < 6 * 240  # they did not run to the end


def test_d_many_clients_disconnect_at_random(server):
    async def one(i):
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            body = {"prompt": f"story {i}", "max_tokens": 200, "stream": True, "ignore_eos": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    await asyncio.sleep(0.001 * (i % 7))
                    if i % 3:
                        return

    async def run():
        await asyncio.gather(*(one(i) for i in range(100)))

    asyncio.run(run())
    wait_idle(server, timeout=10)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_d4_a_stream_nobody_reads_is_aborted_then_dropped(impatient_server):
    server = impatient_server
    other = {"prompt": "tell me a story", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    solo = post(server, "/v1/completions", other).json()["choices"][0]["text"]
    # 16 choices x 480 tokens x ~1.8 KB of logprobs: ~13 MB, more than the kernel buffers between us
    unread = {"messages": [{"role": "user", "content": "hi"}], "n": 16, "max_tokens": 480, "ignore_eos": True,
              "logprobs": True, "top_logprobs": 20, "stream": True}
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", server.port))
        s.sendall(raw_post("/v1/chat/completions", json.dumps(unread).encode()))  # and read nothing
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**other, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        wait_idle(server, timeout=20)  # aborted in the engine, its pages freed
        deadline = time.monotonic() + 10
        while "read nothing for 2 s" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        s.settimeout(10)
        read_to_end(s)  # the server has hung up
    assert "".join(c["choices"][0]["text"] for c in chunks) == solo  # the other stream did not notice
    log = server.log()
    assert log.index("stopped reading the stream") < log.index("read nothing for 2 s")


# -- C8: authentication and tenants ----------------------------------------------------------------
KEY_A, KEY_B = "key-aaaaaaaa", "key-bbbbbbbb"


@pytest.fixture(scope="module")
def auth_server(model_dir):
    proc = start_server(model_dir, *COMMON, "--api-key", KEY_A, "--api-key", KEY_B)
    yield proc
    assert proc.stop() == 0, proc.log()


def app_routes():
    app = build_app(SimpleNamespace(config=ServerConfig(), serving=None))
    return [(route.path, sorted(route.methods - {"HEAD"})) for route in app.routes if hasattr(route, "methods")]


def test_a1_every_route_needs_a_key(auth_server):
    routes = app_routes()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/metrics"} <= {p for p, _ in routes}
    for path, methods in routes:
        for method in methods:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY_A}"}):
                r = httpx.request(method, f"{auth_server.base_url}{path}", headers=headers, json={})
                if path in ("/health", "/metrics") or is_page_path(path):  # open by design (/metrics unless
                    assert r.status_code == 200  # --protect-metrics; the playground's page holds no data)
                elif is_admin_path(path):  # no --admin-api-key here: the admin routes do not exist
                    error_of(r, 404)
                else:
                    error_of(r, 401, code="invalid_api_key")
    ok = httpx.post(f"{auth_server.base_url}/v1/completions", headers={"Authorization": f"Bearer {KEY_A}"},
                    json={"prompt": "x", "max_tokens": 1})
    assert ok.status_code == 200


@pytest.mark.parametrize("path", ["//v1/completions", "/v1/./completions", "/v1%2Fcompletions", "/v1/completions/",
                                  "/V1/COMPLETIONS", "/nope"])
@pytest.mark.parametrize("method", ["POST", "GET", "HEAD", "OPTIONS"])
def test_a3_path_tricks_never_pass_unauthenticated(auth_server, path, method):
    with socket.create_connection(("127.0.0.1", auth_server.port)) as s:
        body = b'{"prompt": "x", "max_tokens": 1}'
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        status = int(s.recv(4096).split(b" ", 2)[1])
    assert status == 401  # authentication comes before routing: no 404/405 tells a stranger what exists


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_a3_unknown_paths_are_401_without_a_key_and_404_with_one(auth_server, method):
    for path in ("/nope", "/v1/nope", "/v1/completions/x"):
        error_of(httpx.request(method, f"{auth_server.base_url}{path}"), 401, code="invalid_api_key")
        error_of(httpx.request(method, f"{auth_server.base_url}{path}", headers={"Authorization": f"Bearer {KEY_A}"}), 404)


def test_a5_tenants_never_share_cached_prompts(auth_server):
    secret = "The launch code is 0000; the launch code is 0000; the launch code is 0000." * 2

    def ask(key):
        c = openai.OpenAI(base_url=f"{auth_server.base_url}/v1", api_key=key, max_retries=0)
        return c.completions.create(model="tiny", prompt=secret, max_tokens=1).usage.prompt_tokens_details.cached_tokens

    assert ask(KEY_A) == 0
    assert ask(KEY_A) > 0  # the same tenant hits its own cache
    assert ask(KEY_B) == 0  # another tenant never does


def test_d7_disconnects_still_free_the_pages_with_auth_on(auth_server):
    auth = {"Authorization": f"Bearer {KEY_A}"}
    body = {"prompt": "tell me a long story", "max_tokens": 240, "ignore_eos": True}
    with httpx.stream("POST", f"{auth_server.base_url}/v1/completions", json={**body, "stream": True}, headers=auth,
                      timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        next(lines)
    wait_idle(auth_server, timeout=5)
    # gone long before its 240 tokens are done (a quiet machine does them in about 0.2 s)
    impatient = httpx.Timeout(5.0, read=0.03)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{auth_server.base_url}/v1/completions", json=body, headers=auth, timeout=impatient)
    wait_idle(auth_server, timeout=5)


GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
MIXED_BATCH = [
    {"prompt": "The quick brown fox", **GREEDY},
    {"prompt": "The quick brown fox", **GREEDY, "presence_penalty": 1.5, "frequency_penalty": 0.5},
    {"prompt": "The quick brown fox", **GREEDY, "repetition_penalty": 1.3},
    {"prompt": "The quick brown fox", **GREEDY, "logit_bias": {"40": 6, "41": -100, "300": 3}},
    {"prompt": "Paged attention", **GREEDY, "stop": ["e", "at"]},
    {"prompt": "Paged attention", **GREEDY, "n": 3},
    {"prompt": "Paged attention", **GREEDY, "logprobs": 5},
    {"prompt": "Paged attention", **GREEDY, "temperature": 1.0, "seed": 7, "n": 2},
    {"prompt": "Paged attention", **GREEDY, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 3},
    {"prompt": [5, 6, 7, 8], **GREEDY, "temperature": 1.0, "min_p": 0.2, "seed": 11, "logprobs": 2},
    {"prompt": "A radix tree", "temperature": 0, "max_tokens": 24, "min_tokens": 10, "stop_token_ids": [2, 7]},
]


def test_a8_a_mixed_batch_gives_each_request_its_solo_output(server):
    def outcome(response):
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        exact = [(c["text"], c["finish_reason"], c["stop_reason"], c["logprobs"] and c["logprobs"]["tokens"])
                 for c in choices]
        return exact, [c["logprobs"] and c["logprobs"]["token_logprobs"] for c in choices]

    solo = [outcome(post(server, "/v1/completions", body)) for body in MIXED_BATCH]

    async def together():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            bodies = MIXED_BATCH + MIXED_BATCH[::-1]
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for body in bodies))

    batched = [outcome(r) for r in asyncio.run(together())]
    for i, (exact, logprobs) in enumerate(batched):
        j = i if i < len(MIXED_BATCH) else 2 * len(MIXED_BATCH) - 1 - i
        assert exact == solo[j][0], MIXED_BATCH[j]  # text, finish and chosen tokens byte for byte
        for ours, theirs in zip(logprobs, solo[j][1]):
            assert ours == theirs or ours == pytest.approx(theirs, abs=1e-4)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def inet_sockets() -> dict[str, tuple[str, str, int, str]]:
    """inode -> (protocol, local address, port, TCP state in hex) for every TCP/UDP socket, IPv4 and IPv6."""
    found = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        with open(f"/proc/net/{proto}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # 32-bit words, host order
                family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
                found[fields[9]] = (proto, socket.inet_ntop(family, raw), int(port, 16), fields[3])
    return found


def test_a9_only_the_api_port_listens_and_the_core_talks_over_unix_sockets(server):
    core = descendants(server.proc.pid)
    assert core, "the engine core runs as a child process"
    inet = inet_sockets()
    listening = [inet[i][1:3] for i in socket_inodes(server.proc.pid) if i in inet and inet[i][3] == "0A"]
    assert listening == [("127.0.0.1", server.port)]
    with open("/proc/net/unix") as f:
        unix = {line.split()[6] for line in f.readlines()[1:]}
    for pid in core:
        sockets = socket_inodes(pid)
        assert not sockets & inet.keys(), [inet[i] for i in sockets & inet.keys()]  # no TCP or UDP at all
    assert any(socket_inodes(pid) & unix for pid in core)


# -- C7: load and faults -----------------------------------------------------------------------------
def test_l1_queue_full_gets_503_with_retry_after(model_dir):
    proc = start_server(model_dir, *COMMON, "--max-queued-requests", "2")
    try:
        async def one(http):
            return await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 64, "ignore_eos": True})

        async def run():
            async with httpx.AsyncClient(base_url=proc.base_url, timeout=60) as http:
                return await asyncio.gather(*(one(http) for _ in range(12)))

        responses = asyncio.run(run())
        statuses = sorted(r.status_code for r in responses)
        assert statuses.count(200) >= 2 and 503 in statuses and set(statuses) <= {200, 503}
        assert all(r.headers.get("retry-after") for r in responses if r.status_code == 503)
    finally:
        assert proc.stop() == 0


def test_rate_limit_gets_429_with_retry_after(model_dir):
    proc = start_server(model_dir, *COMMON, "--requests-per-minute", "3")
    try:
        statuses = [post(proc, "/v1/completions", {"prompt": "x", "max_tokens": 1}) for _ in range(5)]
        assert [r.status_code for r in statuses] == [200, 200, 200, 429, 429]
        assert float(statuses[-1].headers["retry-after"]) > 0
        error_of(statuses[-1], 429, code="rate_limit_exceeded")
    finally:
        assert proc.stop() == 0


def test_l4_engine_failure_errors_everyone_and_exits_nonzero(model_dir):
    proc = start_server(model_dir, *COMMON, "--fault", "raise-after-steps=40")
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{proc.base_url}/v1/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
    assert httpx.get(f"{proc.base_url}/health", timeout=5).status_code == 503 or proc.proc.poll() is not None
    proc.proc.wait(timeout=10)
    assert proc.proc.returncode not in (0, None)


def test_l6_sigterm_drains_in_flight_requests(model_dir):
    proc = start_server(model_dir, *COMMON, "--shutdown-timeout", "30")
    body = {"prompt": "x", "max_tokens": 120, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{proc.base_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        refused = post(proc, "/v1/completions", {"prompt": "x", "max_tokens": 1}, timeout=5)
        rest = [line for line in lines if line]
    error_of(refused, 503)
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert proc.proc.wait(timeout=20) == 0


def test_l6_sigterm_with_no_drain_time_aborts_and_waits_for_no_render(model_dir):
    # The core sleeps 2 s in its third step, so the stream is still running when SIGTERM comes (a tiny model
    # on a quiet machine otherwise finishes 240 tokens before it).
    proc = start_server(model_dir, *COMMON, "--shutdown-timeout", "0", "--allow-request-chat-template", "--render-timeout",
                        "120", "--fault", "sleep-after-steps=3:2")  # fmt: skip
    body = {"prompt": "x", "max_tokens": 240, "ignore_eos": True, "stream": True}
    runaway = {"messages": [{"role": "user", "content": "x"}],  # renders for the whole render timeout
               "chat_template": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"}
    with ThreadPoolExecutor(1) as pool, httpx.stream("POST", f"{proc.base_url}/v1/completions", json=body, timeout=60) as r:
        rendering = pool.submit(lambda: (post(proc, "/v1/chat/completions", runaway), time.monotonic()))
        lines = r.iter_lines()
        next(lines)
        time.sleep(0.5)
        proc.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        rest = [line for line in lines if line]
        rendered, answered = rendering.result()
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
    error_of(rendered, 503, code="shutting_down")
    assert answered - start < 2  # the render was stopped, not waited for
    assert proc.proc.wait(timeout=10) == 0 and time.monotonic() - start < 5


def test_l5_a_wedged_engine_turns_health_503_until_it_moves_again(model_dir):
    proc = start_server(model_dir, *COMMON, "--fault", "sleep-after-steps=3:3", "--wedge-timeout", "1")
    try:
        polls = []  # (when, status)

        def poll() -> None:
            polls.append((time.monotonic(), httpx.get(f"{proc.base_url}/health", timeout=5).status_code))
            time.sleep(0.1)

        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(post, proc, "/v1/completions", {"prompt": "x", "max_tokens": 10, "ignore_eos": True})
            while not future.done():
                poll()
        deadline = time.monotonic() + 5
        while polls[-1][1] != 200 and time.monotonic() < deadline:
            poll()
        response = future.result()
    finally:
        assert proc.stop() == 0, proc.log()
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 10
    wedged = [at for at, status in polls if status == 503]
    # ~2 s of the 3 s wedge (timed, not counted: a loaded machine polls more slowly)
    assert wedged and wedged[-1] - wedged[0] >= 1.0, polls
    assert polls[-1][1] == 200


def test_logs_carry_no_prompt_text(model_dir, server):
    post(server, "/v1/completions", {"prompt": "my secret diary entry", "max_tokens": 2})
    post(server, "/v1/completions", {"prompt": "my secret diary entry", "temperature": "bad"})
    assert "secret diary" not in server.log()

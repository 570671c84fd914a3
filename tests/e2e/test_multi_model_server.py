"""Several models behind one `banyan serve`, as clients and operators see it: the default model and a tiny
random one from the command line, more loaded, swapped and unloaded through the admin API while 16 clients
keep asking, an A/B route over them. One real server on 127.0.0.1, the official openai client."""

from __future__ import annotations

import asyncio
import os
import re
import time

import httpx
import openai
import pytest

from banyan.server.routing import parse_route
from tests.factories import reference_greedy, write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

USER_KEY, ADMIN_KEY = "user-key-mm", "admin-key-mm"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = "The quick brown fox"
TINY_ARGS = {"kv_cache_memory": "16MiB", "max_model_len": 128, "block_size": 4, "num_threads": 1}
ROUTE = "chat=tiny:90,smol:10"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Three tiny random models of one shape, different weights: (path, transformers model) each."""
    out = {}
    for name, seed in [("tiny", 4), ("other", 7), ("slow", 9)]:
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, write_model_dir(path, "llama", seed=seed))
    return out


@pytest.fixture(scope="module")
def server(dirs):
    tiny = str(dirs["tiny"][0])
    proc = start_server(
        tiny, "--served-model-name", "tiny", "--kv-cache-memory", "16MiB", "--max-model-len", "128",
        "--fault", "sleep-while-loading=0",  # a no-op that lets admin loads carry test faults
        "--model", "smollm2-135m-instruct", "--served-model-name", "smol", "--kv-cache-memory", "32MiB",
        "--max-model-len", "512", "--num-threads", "1",
        "--api-key", USER_KEY, "--admin-api-key", ADMIN_KEY, "--route", ROUTE,
        "--memory-budget", "6GiB",  # not the machine's free RAM: other work on it must not decide the loads
        ready_timeout=300)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=USER_KEY, max_retries=0)


def admin(server, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, f"{server.base_url}{path}", headers=ADMIN, timeout=60, **kw)


def entries(server) -> dict[str, dict]:
    """GET /admin/models by name (an entry draining after a swap under its old source)."""
    return {(e["name"] if e["state"] != "draining" else f"{e['name']}@draining"): e
            for e in admin(server, "GET", "/admin/models").json()["data"]}


def wait_for(predicate, what: str, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read()


def greedy(client, model: str, prompt: str = PROMPT, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def decoded_reference(server, dirs, name: str) -> str:
    """What the tiny model `name` answers PROMPT, by transformers on the same weights (one tokenizer for all three)."""
    def post(path: str, body: dict) -> dict:
        return httpx.post(f"{server.base_url}{path}", json={"model": "tiny", **body}, timeout=60,
                          headers={"Authorization": f"Bearer {USER_KEY}"}).json()

    ids = post("/tokenize", {"prompt": PROMPT})["tokens"]
    return post("/detokenize", {"tokens": reference_greedy(dirs[name][1], ids, 3)})["prompt"]


# -- two models behind one server -----------------------------------------------------------------
def test_requests_go_to_the_model_they_name(server, client, dirs):
    tiny = greedy(client, "tiny")
    assert tiny.model == "tiny" and tiny.choices[0].text == decoded_reference(server, dirs, "tiny")
    smol = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": PROMPT}], max_tokens=2)
    assert smol.model == "smol"
    # each model's own tokenizer counted the prompt: the default model's chat template adds a system turn
    assert smol.usage.prompt_tokens > 20 and tiny.usage.prompt_tokens < 10
    with pytest.raises(openai.NotFoundError) as e:
        greedy(client, "nonexistent")
    assert e.value.body["code"] == "model_not_found"


def test_v1_models_lists_every_model_and_route(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "smol", "chat"}
    assert cards["smol"].max_model_len == 512 and cards["tiny"].max_model_len == 128
    assert cards["chat"].route == {"tiny": 90.0, "smol": 10.0}


def test_metrics_carry_each_models_name(server, client):
    greedy(client, "tiny")
    greedy(client, "smol")
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("tiny", "smol"):
        assert re.search(rf'banyan:request_success_total{{finished_reason="length",model_name="{name}"}} [1-9]', text)
        assert f'banyan:kv_cache_usage_perc{{model_name="{name}"}}' in text
    assert text.count("# TYPE banyan:kv_cache_usage_perc gauge") == 1


# -- the admin API's keys ---------------------------------------------------------------------------
@pytest.mark.parametrize("headers, status", [({}, 401), ({"Authorization": f"Bearer {USER_KEY}"}, 403),
                                             ({"Authorization": "Bearer wrong"}, 401)])
def test_admin_routes_need_the_admin_key(server, headers, status):
    for method, path in [("GET", "/admin/models"), ("POST", "/admin/models"), ("DELETE", "/admin/models/tiny"),
                         ("POST", "/admin/models/tiny/swap"), ("PUT", "/admin/routes/chat")]:
        assert httpx.request(method, f"{server.base_url}{path}", headers=headers, json={}).status_code == status


def test_admin_lists_the_models_with_their_memory(server):
    listed = entries(server)
    assert {"tiny", "smol"} <= set(listed)
    for name in ("tiny", "smol"):
        assert listed[name]["state"] == "ready" and listed[name]["memory_bytes"] > 100 * 2**20
        assert pid_alive(listed[name]["pid"])


@pytest.mark.parametrize("body, param", [
    ({"name": "x", "model": "/nowhere", "engine_args": {}}, "model"),
    ({"name": "x", "model": "smollm2-135m-instruct", "engine_args": {"max_model_len": "long"}},
     "engine_args.max_model_len"),
    ({"name": "x", "model": "smollm2-135m-instruct", "engine_args": {"max_modle_len": 5}}, "engine_args.max_modle_len"),
    ({"name": "", "model": "smollm2-135m-instruct"}, "name"),
])
def test_a_bad_load_is_400_naming_the_field(server, body, param):
    r = admin(server, "POST", "/admin/models", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_load_that_does_not_fit_is_refused_and_the_running_models_keep_serving(server, client, dirs):
    r = admin(server, "POST", "/admin/models", json={"name": "huge", "model": str(dirs["other"][0]),
                                                      "engine_args": {**TINY_ARGS, "kv_cache_memory": "64TiB"}})
    assert r.status_code == 409 and r.json()["error"]["code"] == "memory_budget_exceeded"
    message = r.json()["error"]["message"]
    assert re.search(r"'huge' needs 65536\.\d\d GiB \(weights .* \+ KV cache 65536\.00 GiB", message), message
    assert re.search(r"only \d+\.\d\d GiB is free \(--memory-budget 6\.00 GiB", message), message
    assert "loaded: tiny" in message and "smol" in message
    assert "huge" not in entries(server)
    assert greedy(client, "tiny").model == "tiny" and greedy(client, "smol").model == "smol"


def test_a_name_in_use_is_409(server, dirs):
    r = admin(server, "POST", "/admin/models", json={"name": "tiny", "model": str(dirs["other"][0])})
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_exists"


# -- load, swap and unload under a continuous stream --------------------------------------------------
class Traffic:
    """16 clients asking the models in `targets` in turn, streaming or not, until stopped; every answer kept."""

    def __init__(self, server):
        self.server = server
        self.targets = ["tiny", "smol"]
        self.answers: list[tuple[str, str, str]] = []  # (asked, answered by, text)
        self.failures: list[str] = []
        self.running: dict[str, int] = {}
        self.stop = False

    async def one_client(self, k: int) -> None:
        aclient = openai.AsyncOpenAI(base_url=f"{self.server.base_url}/v1", api_key=USER_KEY, max_retries=0,
                                     timeout=120)
        i = k
        while not self.stop:
            model = self.targets[i % len(self.targets)]
            i += 1
            self.running[model] = self.running.get(model, 0) + 1
            try:
                kw = {"model": model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                      "extra_body": {"ignore_eos": True}}
                if i % 2:
                    out = await aclient.completions.create(**kw)
                    self.answers.append((model, out.model, out.choices[0].text))
                else:
                    chunks = [c async for c in await aclient.completions.create(stream=True, **kw)]
                    text = "".join(c.choices[0].text for c in chunks if c.choices)
                    assert chunks[-1].choices[0].finish_reason == "length"
                    self.answers.append((model, chunks[0].model, text))
            except Exception as e:  # noqa: BLE001 - any failure at all is a defect here
                self.failures.append(f"{model}: {e!r}")
            finally:
                self.running[model] -= 1
        await aclient.close()

    async def run(self, operate) -> None:
        clients = [asyncio.ensure_future(self.one_client(k)) for k in range(16)]
        try:
            await asyncio.to_thread(operate, self)
        finally:
            self.stop = True
            await asyncio.gather(*clients)


def test_load_swap_and_unload_under_16_clients_fail_no_request(server, client, dirs):
    # the default model's kernels differ with the batch width (docs/quantization.md): its text is not checked
    expected = {"tiny": {decoded_reference(server, dirs, "tiny")}, "smol": None}
    other = decoded_reference(server, dirs, "other")
    assert other not in expected["tiny"]  # the swap is visible in the answers
    baseline = entries(server)

    def operate(traffic: Traffic) -> None:
        wait_for(lambda: len(traffic.answers) >= 16, "the first answers")
        # load: answers 'loading' at once, then ready
        r = admin(server, "POST", "/admin/models", json={"name": "extra", "model": str(dirs["other"][0]),
                                                          "engine_args": TINY_ARGS})
        assert r.status_code == 200 and r.json()["state"] == "loading", r.text
        wait_for(lambda: entries(server)["extra"]["state"] == "ready", "extra ready")
        expected["extra"] = {other}
        traffic.targets.append("extra")
        wait_for(lambda: sum(a[0] == "extra" for a in traffic.answers) >= 8, "answers from extra")
        # swap tiny to the other weights: answers are the old model's, then the new one's, never an error
        old_pid = entries(server)["tiny"]["pid"]
        r = admin(server, "POST", "/admin/models/tiny/swap", json={"model": str(dirs["other"][0])})
        assert r.status_code == 200 and r.json()["swap"]["state"] == "loading", r.text
        expected["tiny"].add(other)
        wait_for(lambda: entries(server)["tiny"]["model"] == str(dirs["other"][0]), "the swap")
        wait_for(lambda: not pid_alive(old_pid), "the old core to exit")
        # the entry leaves once the registry has seen its core exit, a poll after the process is gone
        wait_for(lambda: "tiny@draining" not in entries(server), "the draining entry to leave")
        # unload extra once no client asks it any more
        traffic.targets.remove("extra")
        wait_for(lambda: traffic.running.get("extra", 0) == 0, "extra's last requests")
        extra_pid = entries(server)["extra"]["pid"]
        assert admin(server, "DELETE", "/admin/models/extra").json()["state"] == "draining"
        wait_for(lambda: not {"extra", "extra@draining"} & set(entries(server)), "extra gone")
        assert not pid_alive(extra_pid)
        wait_for(lambda: sum(a[0] == "tiny" and a[2] == other for a in traffic.answers) >= 8, "answers after the swap")

    traffic = Traffic(server)
    asyncio.run(traffic.run(operate))
    assert traffic.failures == [], traffic.failures[:5]
    assert len(traffic.answers) > 100
    for asked, answered, text in traffic.answers:
        assert answered == asked and (expected[asked] is None or text in expected[asked]), (asked, answered, text)
    after = entries(server)
    assert set(after) == {"tiny", "smol"}  # memory back to the baseline: two cores, the others exited
    assert after["tiny"]["memory_estimate_bytes"] == baseline["tiny"]["memory_estimate_bytes"]
    assert not pid_alive(baseline["tiny"]["pid"])  # the swapped-out core
    text = httpx.get(f"{server.base_url}/metrics").text
    assert 'model_name="extra"' not in text  # its series (KV gauges included) left with it


def test_unload_drains_then_aborts_what_is_still_running(server, dirs):
    r = admin(server, "POST", "/admin/models", json={"name": "slow", "model": str(dirs["slow"][0]), "engine_args": TINY_ARGS,
                                                      "fault": "sleep-after-steps=4:30"})  # its 4th step: 30 s
    assert r.status_code == 200, r.text
    wait_for(lambda: entries(server)["slow"]["state"] == "ready", "slow ready")
    pid = entries(server)["slow"]["pid"]
    aclient = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=USER_KEY, max_retries=0, timeout=60)
    stream = aclient.completions.create(model="slow", prompt=PROMPT, max_tokens=50, stream=True,
                                        extra_body={"ignore_eos": True})
    first = next(iter(stream))  # a token came; step 4 sleeps: the request cannot finish within the drain
    assert first.model == "slow"
    assert admin(server, "DELETE", "/admin/models/slow", params={"timeout": 0.2}).status_code == 200
    with pytest.raises(openai.NotFoundError):  # no new request reaches it
        greedy(aclient, "slow")
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason == "abort"
    wait_for(lambda: not {"slow", "slow@draining"} & set(entries(server)), "slow gone", timeout=60)
    assert not pid_alive(pid)


def test_a_model_that_is_loading_answers_503_with_retry_after(server, client, dirs):
    r = admin(server, "POST", "/admin/models", json={"name": "later", "model": str(dirs["slow"][0]), "engine_args": TINY_ARGS,
                                                      "fault": "sleep-while-loading=30"})
    assert r.status_code == 200
    with pytest.raises(openai.APIStatusError) as e:
        greedy(client, "later")
    assert e.value.status_code == 503 and e.value.body["code"] == "model_loading"
    assert e.value.response.headers["retry-after"] == "5"
    assert admin(server, "DELETE", "/admin/models/later", params={"timeout": 0}).status_code == 200
    wait_for(lambda: "later" not in entries(server), "the loading model removed", timeout=60)


# -- A/B routes -------------------------------------------------------------------------------------
def test_a_route_sends_each_user_to_one_variant_and_says_which(server, client):
    route = parse_route(ROUTE)
    users = [f"u{i}" for i in range(24)]
    for user in users:
        out = client.completions.create(model="chat", prompt=PROMPT, max_tokens=1, user=user)
        assert out.model == route.choose(f"user:{user}")
        again = client.completions.create(model="chat", prompt=PROMPT, max_tokens=1, user=user)
        assert again.model == out.model  # sticky
    text = httpx.get(f"{server.base_url}/metrics").text
    counts = {v: float(m) for v, m in re.findall(r'banyan:route_requests_total\{route="chat",variant="(\w+)"\} (\S+)', text)}
    assert sum(counts.values()) == 48
    assert 'banyan:route_time_to_first_token_seconds_count{route="chat",variant="tiny"}' in text


def test_route_weights_change_live(server, client):
    r = admin(server, "PUT", "/admin/routes/chat", json={"variants": {"tiny": 0, "smol": 1}})
    assert r.status_code == 200 and r.json()["variants"] == {"smol": 1.0}
    assert {client.completions.create(model="chat", prompt=PROMPT, max_tokens=1, user=f"w{i}").model
            for i in range(6)} == {"smol"}
    assert admin(server, "PUT", "/admin/routes/chat", json={"variants": {"nope": 1}}).status_code == 400
    assert admin(server, "PUT", "/admin/routes/chat", json={"variants": {"tiny": 9, "smol": 1}}).status_code == 200


def test_a_loaded_model_whose_core_dies_fails_alone(server, client, dirs):
    r = admin(server, "POST", "/admin/models", json={"name": "crashy", "model": str(dirs["slow"][0]),
                                                      "engine_args": TINY_ARGS, "fault": "raise-after-steps=1"})
    assert r.status_code == 200, r.text
    wait_for(lambda: entries(server)["crashy"]["state"] == "ready", "crashy ready")
    pid = entries(server)["crashy"]["pid"]
    with pytest.raises(openai.APIStatusError):  # its first step raises: the core exits, its request fails
        greedy(client, "crashy")
    failed = wait_for(lambda: entries(server)["crashy"]["state"] == "failed" and entries(server)["crashy"], "failed")
    assert "engine core died" in failed["error"]
    wait_for(lambda: not pid_alive(pid), "the dead core reaped", timeout=30)
    with pytest.raises(openai.NotFoundError):
        greedy(client, "crashy")
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert greedy(client, "tiny").model == "tiny" and greedy(client, "smol").model == "smol"

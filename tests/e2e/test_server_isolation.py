"""What one request, or the server's working directory, may not do to the others (RELIABILITY M1/M2, rule 1).

A request chat template is a program: when it fails it is the request's fault (400 naming
`chat_template`), and when it runs past the render cap it stops using CPU, so that two runaway
templates cannot hold the tokenizing workers from everyone else, nor keep the server from exiting.
A client's X-Request-Id is a label, never a key. The engine core runs the server's own code.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.test_server_reliability import COMMON, error_of, post
from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

RENDER_TIMEOUT = 1.0
RUNAWAY = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
"""A loop nest with no output: 10^10 turns, one CPU for hours, if nothing stops it."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_isolation")
    write_model_dir(path, "llama", seed=6)
    return path


FAKE_BANYAN = 'raise SystemExit("imported the banyan package of the working directory")\n'


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """Started from a directory holding a `banyan` package that fails on import, by the console script
    (Python puts no working directory on its path): the server and its core must run the real one."""
    script = Path(sys.executable).with_name("banyan")
    if not script.exists():
        pytest.skip("no banyan console script next to the interpreter")
    cwd = tmp_path_factory.mktemp("cwd_with_a_fake_banyan")
    for package in (cwd / "banyan", cwd / "banyan" / "ipc", cwd / "banyan" / "engine"):
        package.mkdir()
        (package / "__init__.py").write_text(FAKE_BANYAN)
    proc = start_server(model_dir, *COMMON, "--allow-request-chat-template", "--render-timeout", str(RENDER_TIMEOUT),
                        launcher=[str(script)], cwd=cwd)  # fmt: skip
    yield proc
    assert proc.stop(timeout=15) == 0, proc.log()


def chat(template: str | None = None, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return body if template is None else {**body, "chat_template": template}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime, stime in clock ticks (USER_HZ = 100)


@pytest.mark.parametrize(
    "template",
    [
        "{% if %}{% endif %}",  # does not compile
        "{{ raise_exception('this template refuses everything') }}",
        "{{ ''.__class__.__mro__ }}",  # an attribute the sandbox refuses
        "{{ cycler.__init__.__globals__ }}",
        "{{ messages[0].content.nope.deeper }}",  # fails on the messages it is given
    ],
)
def test_m2_a_failing_request_template_is_a_400_naming_it(server, template):
    error_of(post(server, "/v1/chat/completions", chat(template)), 400, param="chat_template")
    assert post(server, "/v1/chat/completions", chat()).status_code == 200


def test_m1_runaway_templates_are_stopped_not_just_answered(server):
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # two: as many as the server's tokenizing workers
        runaways = list(pool.map(lambda _: post(server, "/v1/chat/completions", chat(RUNAWAY)), range(2)))
    for response in runaways:
        error = error_of(response, 400, param="chat_template")
        assert f"{RENDER_TIMEOUT:g} s" in error["message"]
    assert time.monotonic() - started < RENDER_TIMEOUT + 3
    before = cpu_seconds(server.proc.pid)
    time.sleep(1.0)
    assert cpu_seconds(server.proc.pid) - before < 0.3  # the renders stopped (running, they use 2 CPUs)
    start = time.monotonic()
    assert post(server, "/v1/chat/completions", chat()).status_code == 200  # the workers are free again
    assert time.monotonic() - start < 5


def test_concurrent_requests_may_carry_the_same_request_id(server):
    def send(_):
        return post(server, "/v1/completions", {"prompt": "x", "max_tokens": 16, "ignore_eos": True, "n": 2},
                    headers={"X-Request-Id": "same1"})  # fmt: skip

    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(send, range(3)))
    for r in responses:
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "same1"  # echoed as sent
        assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]


def test_the_core_runs_the_servers_own_banyan_whatever_the_working_directory(server):
    assert Path(f"/proc/{server.proc.pid}/cwd").resolve().joinpath("banyan", "__init__.py").read_text() == FAKE_BANYAN
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
    assert "imported the banyan package" not in server.log()

"""A backend that dies in the middle of run_batch: every program's state comes back, each with its
result or a typed error naming the call, none lost; later programs fail at once with the same type."""

from __future__ import annotations

import threading

import pytest

import banyan.lang as bl
from banyan.engine.faults import Fault
from tests.factories import write_model_dir
from tests.server_process import start_server

pytestmark = pytest.mark.slow

NUM_PROGRAMS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_lang_failures")
    write_model_dir(path, "llama", seed=7)
    return path


@bl.function
def two_gens(s, index, ready=None, killed=None):
    s += f"Program {index}:" + bl.gen("first", max_tokens=8, ignore_eos=True)
    if ready is not None:  # program 0 holds its second call until the backend is gone
        assert s["first"]  # `s += gen` returns at once; reading the variable waits for the call
        ready.set()
        assert killed.wait(60), "the test never killed the backend"
    s += " then" + bl.gen("second", max_tokens=8, ignore_eos=True)


def _check_all_back(states) -> list[BaseException]:
    """Every state is here; each has its two answers or a typed error naming the call. Returns the errors."""
    assert len(states) == NUM_PROGRAMS
    errors = []
    for state in states:
        error = state.error()
        if error is None:
            assert state["first"] and state["second"]
        else:
            assert isinstance(error, bl.BackendError), repr(error)
            assert error.call in ("gen('first')", "gen('second')")
            errors.append(error)
    return errors


def test_the_engine_failing_mid_batch(model_dir):
    backend = bl.Engine(str(model_dir), block_size=4, num_threads=1, max_model_len=256)
    backend.llm.engine.before_step.append(Fault("raise", 6))  # the sixth step raises: a fatal engine error
    try:
        states = two_gens.run_batch([{"index": i} for i in range(NUM_PROGRAMS)], temperature=0, backend=backend)
        errors = _check_all_back(states)
        assert errors and all(isinstance(e, bl.BackendUnavailableError) for e in errors)
        later = two_gens.run(index=9, backend=backend).error()
        assert isinstance(later, bl.BackendUnavailableError) and later.call == "gen('first')"
    finally:
        backend.close()


def test_the_server_killed_mid_batch(model_dir):
    proc = start_server(model_dir, "--kv-cache-memory", "64MiB", "--max-model-len", "256")
    ready, killed = threading.Event(), threading.Event()
    backend = bl.RuntimeEndpoint(proc.base_url)
    batch = [{"index": i, **({"ready": ready, "killed": killed} if i == 0 else {})} for i in range(NUM_PROGRAMS)]
    result = {}
    runner = threading.Thread(target=lambda: result.update(states=two_gens.run_batch(batch, backend=backend)))
    try:
        runner.start()
        assert ready.wait(120)
        proc.proc.kill()
        proc.proc.wait(30)
        killed.set()
        runner.join(120)
        assert not runner.is_alive()
        errors = _check_all_back(result["states"])
        first = result["states"][0].error()
        assert isinstance(first, bl.BackendUnavailableError) and first.call == "gen('second')"
        assert errors
    finally:
        killed.set()
        backend.close()
        proc.stop()


def test_the_server_engine_failing_mid_batch(model_dir):
    """The core raises in its 12th step: in-flight calls get the server's error, later ones find no server."""
    proc = start_server(model_dir, "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                        "--fault", "raise-after-steps=12")
    backend = bl.OpenAICompatible(f"{proc.base_url}/v1")
    try:
        states = two_gens.run_batch([{"index": i} for i in range(NUM_PROGRAMS)], temperature=0, backend=backend)
        assert _check_all_back(states)
    finally:
        backend.close()
        proc.stop()


def test_an_api_key_is_sent_and_a_missing_one_is_a_typed_error(model_dir):
    proc = start_server(model_dir, "--kv-cache-memory", "64MiB", "--max-model-len", "256", "--api-key", "sk-lang")
    try:
        with pytest.raises(bl.BackendError) as refused:
            bl.RuntimeEndpoint(proc.base_url)
        assert refused.value.status == 401 and refused.value.call == "connect"
        backend = bl.RuntimeEndpoint(proc.base_url, api_key="sk-lang")
        try:
            state = two_gens.run(index=1, temperature=0, backend=backend)
            assert state.error() is None and state["second"]
        finally:
            backend.close()
    finally:
        proc.stop()

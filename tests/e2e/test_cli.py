"""`banyan generate` and `banyan chat` as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.factories import write_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_cli")
    write_model_dir(path, "llama", seed=3)
    return path


def banyan(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "banyan.cli", *args], input=stdin, capture_output=True, text=True, timeout=300
    )


def test_generate_prints_completions_and_speed(model_dir):
    run = banyan("generate", "--model", str(model_dir), "--num-threads", "1", "--raw", "--temperature", "0",
                 "--max-tokens", "5", "--prompt", "The quick", "--prompt", "Paged")
    assert run.returncode == 0, run.stderr
    assert "### The quick" in run.stdout and "### Paged" in run.stdout
    assert "generated tokens/s" in run.stderr


def test_chat_streams_replies_until_exit(model_dir):
    run = banyan("chat", "--model", str(model_dir), "--num-threads", "1", "--max-tokens", "4",
                 stdin="hello\n/reset\nagain\n/exit\n")
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("> ") >= 3


def test_bad_model_path_is_a_clear_error(tmp_path):
    run = banyan("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert run.returncode == 1
    assert "banyan:" in run.stderr and "Traceback" not in run.stderr

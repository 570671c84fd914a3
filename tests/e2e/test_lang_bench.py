"""`banyan bench lang` end to end on a tiny model, small settings: every measurement is reported with
both sides' seconds and their ratio (the ratios themselves are performance: benchmarks/README.md)."""

from __future__ import annotations

import json

import pytest

from banyan.cli import main
from tests.factories import write_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.long]  # 10 s: the bench end to end; the lang tests cover what it runs


def test_bench_lang_reports_each_measurement(tmp_path, capsys):
    write_model_dir(tmp_path / "model", "llama", seed=8)
    out = tmp_path / "lang.json"
    code = main(["bench", "lang", "--model", str(tmp_path / "model"), "--block-size", "4", "--num-threads", "1",
                 "--context-tokens", "64", "--branches", "3", "--branch-tokens", "4", "--num-programs", "4",
                 "--program-tokens", "2", "--http-programs", "2", "--http-context-tokens", "32",
                 "--output-json", str(out), "--no-progress"])
    assert code == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"fork", "batch", "http"}
    for r in results.values():
        assert r["baseline_s"] > 0 and r["measured_s"] > 0
        assert r["ratio"] == pytest.approx(r["baseline_s"] / r["measured_s"])
    assert results["fork"]["label"] == "64-token context, 3 forks x 4 tokens"
    assert "| 4 short programs x 2 tokens | one by one |" in capsys.readouterr().out

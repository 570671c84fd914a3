"""`banyan bench`: the latency math on synthetic timings, and each bench run small on a tiny model."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import httpx
import pytest

from banyan.bench.compare_report import _goal_row, peer_failures
from banyan.bench.goals import Goal, judge
from banyan.bench.launcher import ServerStartError, engine_flags, free_port, launched
from banyan.bench.metrics import RequestTiming, meets_slos, parse_goodput, percentile, summarize
from banyan.bench.peers.export_hf import export_hf, hf_dir_for
from banyan.bench.peers.transformers_runner import left_pad, run_transformers
from banyan.bench.plan import CompareConfig, Run
from banyan.bench.workloads import (BenchPrompt, conversations, multi_turn_prompts, random_prompts, shared_prefix_prompts,
                                    sharegpt_prompts, turns)
from banyan.cli import build_parser, engine_config, main
from banyan.kernels.cpu_features import isa
from banyan.errors import InvalidParameterError
from tests.factories import write_model_dir
from tests.server_process import start_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bench")
    write_model_dir(path, "llama", seed=5)
    return path


TINY_ENGINE = ["--num-threads", "1", "--block-size", "4", "--kv-cache-memory", "16MiB", "--max-model-len", "256"]


# -- metric math ----------------------------------------------------------------------------------
def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0


def test_tpot_excludes_the_first_token():
    timing = RequestTiming(success=True, output_tokens=11, ttft=0.5, e2el=1.5, itl=[0.1] * 10)
    assert timing.tpot == pytest.approx(0.1)
    assert RequestTiming(success=True, output_tokens=1, ttft=0.5, e2el=0.5).tpot is None


def test_summary_distributions_and_goodput():
    fast = RequestTiming(success=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2el=0.3, itl=[0.05] * 4)
    slow = RequestTiming(success=True, prompt_tokens=10, output_tokens=5, ttft=0.9, e2el=1.3, itl=[0.1] * 4)
    failed = RequestTiming(success=False, error="HTTP 500")
    summary = summarize([fast, slow, failed], duration=2.0, slos=parse_goodput(["ttft:500", "tpot:60"]))
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["output_throughput"] == 5.0  # 10 tokens / 2 s
    assert summary["ttft_ms"]["mean"] == pytest.approx(500.0)
    assert summary["ttft_ms"]["median"] == pytest.approx(500.0)
    assert summary["tpot_ms"]["p99"] == pytest.approx(99.5)  # tpots 50 and 100 ms
    assert summary["itl_ms"]["mean"] == pytest.approx(75.0)
    assert summary["goodput"] == 0.5  # only `fast` meets both SLOs: 1 request / 2 s
    assert not meets_slos(failed, {})


def test_goodput_spec_is_checked():
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_shared_prefix_groups_share_their_system_prompt():
    prompts = shared_prefix_prompts(2, 3, system_len=16, question_len=4, output_len=2, vocab_size=100)
    assert len(prompts) == 6 and all(len(p.prompt_token_ids) == 20 for p in prompts)
    groups = {tuple(p.prompt_token_ids[:16]) for p in prompts}
    assert len(groups) == 2
    assert len({tuple(p.prompt_token_ids) for p in random_prompts(4, 8, 2, 100)}) == 4


def test_multi_turn_resends_the_growing_history_after_one_shared_system_prompt():
    prompts = multi_turn_prompts(2, 3, system_len=16, user_len=4, output_len=2, vocab_size=100)
    assert [(p.conversation, p.turn) for p in prompts] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert len({tuple(p.prompt_token_ids[:16]) for p in prompts}) == 1  # the system prompt
    for chain in conversations(prompts):
        lengths = [len(p.prompt_token_ids) for p in chain]
        assert lengths == [20, 26, 32]  # + the scripted 2-token reply + a 4-token user turn, per turn
        for before, after in zip(chain, chain[1:]):
            assert after.prompt_token_ids[: len(before.prompt_token_ids)] == before.prompt_token_ids
    assert [len(batch) for batch in turns(prompts)] == [2, 2, 2]
    assert len(conversations(random_prompts(3, 4, 2, 100))) == 3  # lone prompts are chains of one


SHAREGPT = [
    {"id": "long", "conversations": [{"from": "human", "value": "x" * 40}, {"from": "gpt", "value": "y" * 12}]},
    {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "y" * 12}]},
    {"id": "toolong", "conversations": [{"from": "human", "value": "x" * 2000}, {"from": "gpt", "value": "y" * 8}]},
    {"id": "ok", "conversations": [{"from": "human", "value": "x" * 8}, {"from": "gpt", "value": "y" * 6},
                                   {"from": "human", "value": "more"}]},
    {"id": "one turn", "conversations": [{"from": "human", "value": "x" * 8}]},
    "not a conversation",
]


def test_sharegpt_takes_first_exchanges_within_the_length_filters(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    encode = lambda text: [ord(c) for c in text]  # noqa: E731 - one character, one token
    prompts = sharegpt_prompts(path, 10, encode)
    assert sorted((len(p.prompt_token_ids), p.output_len) for p in prompts) == [(8, 6), (40, 12)]
    assert [p.output_len for p in sharegpt_prompts(path, 1, encode, output_len=3)] == [3]
    assert sharegpt_prompts(path, 2, encode, seed=1) == sharegpt_prompts(path, 2, encode, seed=1)
    path.write_text("{not json")
    with pytest.raises(InvalidParameterError, match="sharegpt_path"):
        sharegpt_prompts(path, 1, encode)


def test_left_pad_ends_every_row_at_the_last_column():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_export_hf_writes_weights_transformers_runs_unchanged(model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = export_hf(str(model_dir), tmp_path / "hf")
    ids = torch.tensor([[5, 17, 42, 9]])
    with torch.no_grad():
        original = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()(ids).logits
        exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()(ids).logits
    torch.testing.assert_close(exported, original)
    assert hf_dir_for(str(model_dir)) == model_dir  # a Hugging Face directory is used as it is


def test_the_transformers_peer_counts_the_tokens_it_generated(model_dir):
    """A static batch runs to its longest output; each prompt counts only the tokens it asked for,
    and only as many as generate() returned."""
    prompts = [BenchPrompt([5, 6, 7], 2), BenchPrompt([8, 9], 5), BenchPrompt([10], 3)]
    tokens, seconds = run_transformers(model_dir, prompts, batch_size=2, temperature=0.0, num_threads=1, progress=False)
    assert tokens == 2 + 5 + 3 and seconds > 0
    assert run_transformers(model_dir, prompts, batch_size=3, temperature=0.0, num_threads=1, progress=False,
                            dtype="bfloat16")[0] == 2 + 5 + 3


def test_engine_flags_rebuild_the_engine_config_through_the_serve_parser():
    argv = ["serve", "--model", "m", "--num-threads", "2", "--block-size", "4", "--kv-cache-memory", "16MiB",
            "--no-enable-prefix-caching", "--max-num-seqs", "8"]
    config = engine_config(build_parser().parse_args(argv))
    assert engine_config(build_parser().parse_args(["serve", *engine_flags(config)])) == config


HEALTHY_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_launched_waits_for_health_and_stops_the_server():
    port = free_port()
    with launched([sys.executable, "-c", HEALTHY_SERVER, str(port)], port, ready_timeout=30) as url:
        assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=1.0)


def test_a_server_that_exits_says_why():
    port = free_port()
    crash = "import sys; print('starting'); print('ValueError: no such model'); print('bye'); sys.exit(3)"
    with pytest.raises(ServerStartError) as failure:
        with launched([sys.executable, "-c", crash], port, ready_timeout=30):
            pass
    assert "exited with 3" in failure.value.summary and "ValueError: no such model" in failure.value.summary
    assert str(failure.value) == failure.value.summary  # a traceback names the server's error too


# -- goals ----------------------------------------------------------------------------------------
def _run(scenario, engine, concurrency, **metrics):
    return Run(scenario, engine, concurrency, dict(metrics, failed=0))


def test_goals_compare_with_the_best_baseline_measured():
    runs = [_run("offline", "banyan", 64, output_throughput=500.0),
            _run("offline", "transformers", 32, output_throughput=50.0),
            _run("offline", "llama-server", 64, output_throughput=125.0),
            _run("serve", "banyan", 16, itl_ms={"p99": 50.0}),
            _run("serve", "llama-server", 16, itl_ms={"p99": 100.0})]
    goals = [Goal("offline", "offline", None, "output_throughput", ("transformers", "llama-server"), 5.0),
             Goal("itl", "serve", 16, "itl_ms.p99", ("llama-server",), 1.0, lower_is_better=True),
             Goal("multi-turn", "multi-turn", 8, "output_throughput", ("llama-server",), 3.0)]
    offline, itl, missing = judge(goals, runs)
    assert (offline["baseline"], offline["ratio"], offline["met"]) == ("llama-server", 4.0, False)
    assert (itl["ratio"], itl["met"]) == (2.0, True)  # half llama-server's p99 ITL
    assert missing["met"] is None and "not measured" in missing["note"]


def test_a_goal_row_names_the_peers_it_was_judged_against():
    goal = Goal("offline", "offline", None, "output_throughput", ("transformers", "llama-server"), 5.0)
    runs = [_run("offline", "banyan", 8, output_throughput=100.0), _run("offline", "transformers", 4, output_throughput=50.0)]
    [row] = judge([goal], runs)
    assert row["baselines"] == ["transformers", "llama-server"] and row["judged_against"] == ["transformers"]
    assert row["met"] is False and "not measured: llama-server" in row["note"]
    line = _goal_row(row)
    assert "transformers, ~~llama-server~~ (not measured)" in line and "not met (not measured: llama-server)" in line


def test_a_compare_run_with_a_skipped_peer_or_a_failed_run_is_incomplete():
    def report(runs, skipped):
        return {"results": {"runs": [dataclasses.asdict(r) for r in runs], "skipped": skipped}}

    fine = [_run("offline", "banyan", 8, output_throughput=1.0)]
    assert peer_failures(report(fine, {})) == []
    assert peer_failures(report(fine, {"llama-server": "not found"})) == ["llama-server skipped: not found"]
    failed = [*fine, Run("serve", "llama-server", 1, error="did not start"),
              Run("serve", "transformers", 1, {"failed": 2, "errors": ["x"]})]
    assert peer_failures(report(failed, {})) == ["llama-server serve failed: did not start",
                                                 "transformers serve: 2 failed requests"]


def test_compare_exits_non_zero_when_a_peer_asked_for_is_skipped(model_dir, tmp_path, capsys):
    """llama-server serves GGUF files only: asked for on a Hugging Face directory, it is skipped."""
    argv = ["bench", "compare", "--model", str(model_dir), *TINY_ENGINE, "--quick", "--scenarios", "overhead",
            "--peers", "llama-server", "--no-progress", "--out-dir", str(tmp_path), "--name", "skipped"]
    assert main(argv) == 1
    assert "llama-server skipped:" in capsys.readouterr().err
    assert "llama-server" in json.loads((tmp_path / "skipped.json").read_text())["results"]["skipped"]


def test_an_absolute_goal_is_judged_against_its_target():
    goal = Goal("machinery", "overhead", 256, "output_throughput", (), 30_000.0)
    [row] = judge([goal], [_run("overhead", "banyan", 256, output_throughput=45_000.0)])
    assert (row["baseline"], row["ratio"], row["met"], row["absolute"]) == ("target", 1.5, True, True)
    [row] = judge([goal], [])
    assert row["met"] is None and row["note"]


def test_a_goal_with_a_failed_run_is_not_judged():
    goal = Goal("batch-1", "serve", 1, "decode_tokens_per_s", ("llama-server",), 1.0)
    banyan = _run("serve", "banyan", 1, decode_tokens_per_s=80.0)
    [row] = judge([goal], [banyan, Run("serve", "llama-server", 1, error="did not start")])
    assert row["met"] is None and row["banyan"] == 80.0 and "llama-server failed: did not start" in row["note"]
    flaky = Run("serve", "llama-server", 1, {"failed": 1, "errors": ["HTTP 500"], "decode_tokens_per_s": 90.0})
    [row] = judge([goal], [banyan, flaky])
    assert row["met"] is None and "1 failed requests (HTTP 500)" in row["note"]


def test_compare_config_checks_names_and_always_sweeps_one_and_the_judged_streams():
    cfg = CompareConfig(concurrencies=(4,), streams=16, peers=("none",)).resolved()
    assert cfg.concurrencies == (1, 4, 16) and cfg.peers == ()
    assert CompareConfig(quick=True).resolved().num_prompts < CompareConfig().num_prompts
    with pytest.raises(InvalidParameterError, match="peers"):
        CompareConfig(peers=("vllm",))


def test_the_peers_run_bf16_where_the_cpu_has_amx_tiles_and_float32_elsewhere(monkeypatch):
    """transformers and vLLM-CPU run the Hugging Face export in their fastest dtype for the CPU: bf16 with AMX
    (their matmuls run on its tiles), float32 elsewhere; --peer-dtype says otherwise."""
    from banyan.bench import plan
    from banyan.bench.peers import llama_server

    for flags, want, llama_flags in (({"avx2", "avx512f", "amx_bf16", "amx_int8"}, "bfloat16", ["--no-repack"]),
                                     ({"avx2", "avx512f", "avx512_bf16"}, "float32", [])):
        monkeypatch.setattr(plan, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(llama_server, "cpu_flags", lambda flags=flags: flags)
        assert CompareConfig().resolved().peer_dtype == want
        assert CompareConfig(peer_dtype="float32").resolved().peer_dtype == "float32"
        # llama.cpp's AMX buffers (taken when it repacks) crashed on the default model's Q4_1: its AVX-512 kernels
        cmd = llama_server.llama_server_cmd(Path("/bin/llama-server"), Path("/m.gguf"), 1, parallel=2, slot_len=64,
                                            num_threads=2)
        assert [flag for flag in cmd if "repack" in flag] == llama_flags
    with pytest.raises(InvalidParameterError, match="peer_dtype"):
        CompareConfig(peer_dtype="fp16")


# -- the benches, small ---------------------------------------------------------------------------
def test_overhead_reports_positive_tokens_per_second(model_dir, tmp_path, capsys):
    out = tmp_path / "overhead.json"
    argv = ["bench", "overhead", "--model", str(model_dir), *TINY_ENGINE, "--batch-size", "8", "--input-len", "4",
            "--output-len", "3", "--no-progress", "--output-json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["schema_version"] == 1 and report["bench"] == "overhead"
    assert report["results"]["total_output_tokens"] == 24
    assert report["results"]["output_throughput"] > 0
    table = capsys.readouterr().out
    assert "| output_throughput |" in table
    assert report["machine"]["isa"] == isa() and f"| machine | {report['machine']['cpu']}, {isa()}, " in table


def test_reports_name_the_vector_isa_and_the_extensions_kernels_use():
    assert isa({"avx", "avx2", "fma"}) == "AVX2"
    assert isa({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}) == "AVX-512 (VNNI, BF16)"
    assert isa({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"}) == "AVX-512 (VNNI, BF16, AMX)"
    assert isa({"avx2", "avx_vnni"}) == "AVX2 (AVX-VNNI)"
    assert isa({"neon"}) == "no AVX2" and isa(set()) == "ISA unknown"


def test_throughput_cli_on_a_tiny_model(model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", str(model_dir), *TINY_ENGINE, "--input-len", "8", "--output-len", "4",
            "--num-prompts", "4", "--no-progress", "--output-json", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert results["total_input_tokens"] == 32 and results["total_output_tokens"] == 16
    assert results["request_throughput"] > 0 and results["peak_rss_bytes"] > 0


def test_latency_cli_on_a_tiny_model(model_dir, tmp_path):
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", str(model_dir), *TINY_ENGINE, "--input-len", "8", "--output-len", "4",
            "--num-iters", "1", "--output-json", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert results["ttft_ms"]["mean"] > 0 and results["decode_tokens_per_s"]["mean"] > 0


def test_speculative_cli_runs_every_configuration_side_by_side(model_dir, tmp_path):
    out = tmp_path / "speculative.json"
    argv = ["bench", "speculative", "--model", str(model_dir), *TINY_ENGINE, "--num-prompts", "2", "--output-len", "8",
            "--copy-sentences", "2",
            "--rounds", "2", "--methods", "ngram,suffix", "--policies", "adaptive,fixed", "--output-json", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["off", "ngram-adaptive", "ngram-fixed", "suffix-adaptive", "suffix-fixed"]
    assert results["off"]["ratio"] == 1.0 and "mean_accepted_len" not in results["off"]
    assert results["off"]["round_ratios"] == [1.0, 1.0] and results["off"]["ratio_median"] == 1.0
    for label, r in results.items():
        assert r["total_output_tokens"] == 2 * 2 * 8 and r["output_throughput"] > 0, label
        low, high = min(r["round_ratios"]), max(r["round_ratios"])  # each round's pair, then their median
        assert len(r["round_ratios"]) == 2 and low <= r["ratio_median"] <= high, label
        if label != "off":
            cap = 8 if label.endswith("adaptive") else 5  # each configuration's own default (SpeculativeConfig)
            assert len(r["acceptance_per_pos"]) == cap and r["mean_accepted_len"] >= 1.0
            assert r["num_accepted_tokens"] == sum(r["accepted_per_pos"]) <= r["num_draft_tokens"]


def test_speculative_suffix_options_go_to_the_suffix_configurations_only():
    from banyan.bench.speculative import spec_configs
    from banyan.spec.config import json_object
    options = json_object("suffix_options", '{"suffix_decoding_max_cached_requests": 0}')
    configs = spec_configs(["ngram", "suffix"], ["adaptive", "fixed"], 5, suffix_options=options)
    assert [c.suffix_decoding_max_cached_requests for c in configs.values() if c is not None] == [None, None, 0, 0]
    for text in ("{no", "[0]"):
        with pytest.raises(InvalidParameterError, match="suffix_options"):
            json_object("suffix_options", text)


def test_speculative_cli_mixed_workload_with_network_drafters(model_dir, tmp_path):
    out = tmp_path / "speculative.json"
    argv = ["bench", "speculative", "--model", str(model_dir), *TINY_ENGINE, "--workload", "mixed", "--num-prompts", "2",
            "--output-len", "6", "--copy-sentences", "2", "--input-len", "12", "--rounds", "1",
            "--methods", "layer_skip,draft_model", "--draft-model", str(model_dir), "--policies", "fixed",
            "--num-speculative-tokens", "2", "--output-json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert list(results) == ["off", "layer_skip-fixed", "draft_model-fixed"]
    assert all(r["total_output_tokens"] == 2 * 6 for r in results.values())
    assert results["draft_model-fixed"]["num_draft_tokens"] > 0  # the target drafting for itself
    assert report["config"]["bench"]["workload"] == "mixed"


def test_mixed_workload_interleaves_greedy_copies_and_sampled_random_prompts(model_dir):
    import argparse

    from banyan.bench.speculative import _workload
    from banyan.frontend.llm import LLM

    llm = LLM(str(model_dir), num_threads=1, kv_cache_memory=16 << 20, max_model_len=256)
    try:
        args = argparse.Namespace(workload="mixed", num_prompts=5, output_len=8, copy_sentences=2, input_len=10,
                                  workload_seed=0)
        prompts = _workload(llm, args)
    finally:
        llm.engine.close()
    assert [p.temperature for p in prompts] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert all(len(p.prompt_token_ids) == 10 for p in prompts[1::2])


def test_copy_prompts_ask_to_rewrite_a_seeded_text(model_dir):
    from banyan.bench.speculative import PASSAGE, copy_prompts
    from banyan.frontend.llm import LLM

    llm = LLM(str(model_dir), num_threads=1, kv_cache_memory=16 << 20, max_model_len=256)
    try:
        prompts = copy_prompts(llm, 3, 16, sentences=2, seed=1)
        again = copy_prompts(llm, 3, 16, sentences=2, seed=1)
        text = llm.tokenizer.decode(prompts[0].prompt_token_ids)
    finally:
        llm.engine.close()
    assert [p.prompt_token_ids for p in prompts] == [p.prompt_token_ids for p in again]
    assert prompts[0].prompt_token_ids != prompts[1].prompt_token_ids and prompts[0].output_len == 16
    assert "Rewrite the following text" in text and sum(sentence in text for sentence in PASSAGE) == 2


def test_code_edit_prompts_ask_for_seeded_edits_of_given_code_and_stop_at_the_answers_end(model_dir):
    from banyan.bench.code_edits import EDITS, SNIPPETS, code_edit_prompts
    from banyan.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    pairs = len(SNIPPETS) * len(EDITS)
    prompts = code_edit_prompts(tokenizer, pairs + 2, seed=3)
    assert [p.prompt_token_ids for p in prompts] == [p.prompt_token_ids for p in code_edit_prompts(tokenizer, pairs + 2, seed=3)]
    texts = [tokenizer.decode(p.prompt_token_ids) for p in prompts]
    assert len(set(texts[:pairs])) == pairs  # every (snippet, edit) once before any repeats
    for text, prompt in zip(texts, prompts):
        snippet = next(s for s in SNIPPETS if s.code in text)  # the whole module, to be sent back changed
        assert "Reply with the whole updated code" in text and (snippet.function in text or snippet.variable in text)
        assert not prompt.ignore_eos and prompt.output_len == 2 * len(tokenizer.encode(snippet.code)) + 16
    assert {p.output_len for p in code_edit_prompts(tokenizer, 3, max_tokens=9)} == {9}


def test_speculative_cli_code_edit_workload_emits_the_same_tokens_with_and_without_speculation(model_dir, tmp_path):
    out = tmp_path / "speculative.json"
    argv = ["bench", "speculative", "--model", str(model_dir), "--num-threads", "1", "--block-size", "4",
            "--kv-cache-memory", "32MiB", "--max-model-len", "512", "--workload", "code-edit", "--num-prompts", "2",
            "--output-len", "12", "--rounds", "1", "--methods", "ngram", "--policies", "fixed",
            "--output-json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["config"]["bench"]["workload"] == "code-edit" and report["config"]["bench"]["temperature"] == 0.0
    assert list(results) == ["off", "ngram-fixed"]
    assert 0 < results["off"]["total_output_tokens"] == results["ngram-fixed"]["total_output_tokens"] <= 2 * 12


def test_serve_against_a_real_server(model_dir, tmp_path):
    server = start_server(model_dir, "--kv-cache-memory", "16MiB", "--max-model-len", "256")
    try:
        out = tmp_path / "serve.json"
        argv = ["bench", "serve", "--base-url", server.base_url, "--vocab-size", "300", "--input-len", "8",
                "--output-len", "4", "--num-prompts", "4", "--concurrency", "2", "--goodput", "ttft:60000",
                "--output-json", str(out)]
        assert main(argv) == 0, server.log()
        results = json.loads(out.read_text())["results"]
    finally:
        server.stop()
    assert results["failed"] == 0 and results["completed"] == 4, results["errors"]
    assert results["total_output_tokens"] == 16  # from the server's usage
    assert results["ttft_ms"]["p99"] > 0 and results["goodput"] > 0


def test_throughput_runs_multi_turn_turn_by_turn(model_dir, tmp_path):
    out = tmp_path / "multi_turn.json"
    argv = ["bench", "throughput", "--model", str(model_dir), *TINY_ENGINE, "--workload", "multi-turn", "--num-prompts",
            "6", "--num-turns", "3", "--system-prompt-len", "32", "--input-len", "8", "--output-len", "4", "--no-progress",
            "--output-json", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert results["num_requests"] == 6 and results["total_output_tokens"] == 24
    assert results["total_input_tokens"] == 2 * (40 + 52 + 64)


def test_throughput_on_a_sharegpt_file(model_dir, tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    out = tmp_path / "sharegpt_out.json"
    argv = ["bench", "throughput", "--model", str(model_dir), *TINY_ENGINE, "--workload", "sharegpt", "--sharegpt-path",
            str(path), "--sharegpt-output-len", "4", "--no-progress", "--output-json", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert results["num_requests"] == 2 and results["total_output_tokens"] == 8


@pytest.mark.slow
@pytest.mark.long  # 15 s; CI runs each stage's pieces (the serve bench against a real server, the reports) above
def test_compare_end_to_end_quick(model_dir, tmp_path, capsys):
    """Every scenario on a tiny model: banyan in process, two `banyan serve`s, and transformers (the tiny
    model is a Hugging Face directory already); llama-server is left out, installed or not."""
    argv = ["bench", "compare", "--model", str(model_dir), *TINY_ENGINE, "--quick", "--peers", "transformers",
            "--no-progress", "--out-dir", str(tmp_path), "--name", "quick"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "quick.json").read_text())
    assert report["schema_version"] == 1 and report["bench"] == "compare"
    runs = {(r["scenario"], r["engine"], r["concurrency"]): r for r in report["results"]["runs"]}
    assert not [r["error"] for r in runs.values() if r["error"]]
    assert set(runs) == {("offline", "banyan", 4), ("offline", "transformers", 2), ("batch-1", "banyan", 1),
                         ("serve", "banyan", 1), ("serve", "banyan", 2), ("multi-turn", "banyan", 2),
                         ("multi-turn", "banyan-no-prefix-cache", 2), ("overhead", "banyan", 8)}
    assert runs[("overhead", "banyan", 8)]["metrics"]["total_output_tokens"] == 8 * 4
    assert runs[("offline", "transformers", 2)]["metrics"]["total_output_tokens"] == 16
    assert runs[("multi-turn", "banyan", 2)]["metrics"]["completed"] == 4  # 2 conversations x 2 turns
    goals = {g["goal"].split(":")[0]: g for g in report["results"]["goals"]}
    assert goals["offline 8/4, 4 prompts"]["baseline"] == "transformers"
    assert goals["offline 8/4, 4 prompts"]["met"] in (True, False)
    assert goals["batch-1 decode (1 stream)"]["met"] is None  # no llama-server
    machinery = goals["engine machinery, zero-cost model, batch 8"]
    assert machinery["baseline"] == "target" and machinery["ratio"] == machinery["banyan"] / 30_000
    assert f"({isa()})" in (tmp_path / "quick.md").read_text()  # the machine line names the ISA
    assert "## Goals" in (tmp_path / "quick.md").read_text() and "| offline | transformers |" in capsys.readouterr().out
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "quick-throughput.png").stat().st_size > 0 and (tmp_path / "quick-latency.png").is_file()


def test_the_json_schema_workload_constrains_the_random_prompts(model_dir, tmp_path):
    from banyan.bench.workloads import RECORDS, json_schema_prompts

    constrained, plain = json_schema_prompts(4, 8, 12, 300, seed=3), random_prompts(4, 8, 12, 300, seed=3)
    assert [p.prompt_token_ids for p in constrained] == [p.prompt_token_ids for p in plain]
    assert all(p.structured_outputs == {"json": RECORDS} for p in constrained)
    out = tmp_path / "json_schema.json"
    argv = ["bench", "throughput", "--model", str(model_dir), *TINY_ENGINE, "--workload", "json-schema", "--input-len", "8",
            "--output-len", "12", "--num-prompts", "4", "--no-progress", "--output-json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["results"]["total_output_tokens"] == 48  # every output runs to its length

"""CPU time of the API server process per streamed token, for one or more banyan source trees side by side.

    python benchmarks/api_process_cpu.py [--model DIR] [--tree NAME=SRC ...] [--streams 16] [--rounds 5]

    (a baseline tree: mkdir /tmp/base && git archive <commit> banyan tests | tar -x -C /tmp/base)

Each tree (a directory holding a `banyan` package; default: this checkout) serves the same model with
`banyan serve`; the rounds alternate between the servers, each round 16 concurrent streamed requests
(half /v1/chat/completions, half /v1/completions, as the openai client sends them). The API process's
CPU time (user + system, from /proc/<pid>/stat; its engine core is another process) is read before and
after each round and divided by the tokens the round streamed (its usage chunks). A tiny model keeps the
core's steps short, so the API side is what the numbers show (default: the tests' tiny random Llama, written
to a temporary directory). Medians over rounds; Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.server_process import start_server


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (not its children), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_stream(client, i: int, max_tokens: int) -> int:
    """One streamed request; returns its completion tokens (from the usage chunk)."""
    common = dict(model="m", max_tokens=max_tokens, temperature=1.0, seed=i, stream=True,
                  stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if i % 2:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": f"hello {i}"}], **common)
    else:
        stream = await client.completions.create(prompt=f"Once upon a time {i}", **common)
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


async def load_round(base_url: str, streams: int, max_tokens: int) -> int:
    import openai

    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0) as client:
        return sum(await asyncio.gather(*(one_stream(client, i, max_tokens) for i in range(streams))))


def measure(server, streams: int, max_tokens: int) -> tuple[float, float]:
    """(API CPU microseconds per token, tokens/s of the round)."""
    before, start = process_cpu_seconds(server.proc.pid), time.perf_counter()
    tokens = asyncio.run(load_round(server.base_url, streams, max_tokens))
    wall = time.perf_counter() - start
    return (process_cpu_seconds(server.proc.pid) - before) / tokens * 1e6, tokens / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: a tiny random Llama (tests/factories.py)")
    parser.add_argument("--tree", action="append", default=[], help="NAME=DIR: a source tree holding `banyan`")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serve-args", default="", help="more `banyan serve` flags, e.g. '--num-threads 2'")
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(ROOT)}
    if args.model is None:
        from tests.factories import write_model_dir

        args.model = tempfile.mkdtemp(prefix="banyan-tiny-")
        write_model_dir(args.model, "llama", seed=4)
    servers = {}
    try:
        for name, src in trees.items():
            env = {"PYTHONPATH": str(Path(src).resolve())}
            servers[name] = start_server(args.model, "--served-model-name", "m", "--kv-cache-memory", "256MiB",
                                         "--max-model-len", "512", *shlex.split(args.serve_args), env=env, cwd=src)
            measure(servers[name], args.streams, 8)  # warm-up
        results = {name: [] for name in servers}
        for r in range(args.rounds):
            for name, server in servers.items():
                results[name].append(measure(server, args.streams, args.max_tokens))
                print(f"round {r} {name}: {results[name][-1][0]:.0f} us/token, {results[name][-1][1]:.0f} tok/s", flush=True)
        print(f"\n{args.streams} streams x {args.max_tokens} tokens, {args.rounds} rounds, medians:")
        for name, rows in results.items():
            us = statistics.median(r[0] for r in rows)
            rate = statistics.median(r[1] for r in rows)
            print(f"  {name}: API process {us:.0f} us CPU per token, {rate:.0f} tok/s")
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()

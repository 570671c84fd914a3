"""run_batch of `banyan bench lang`'s short programs with the shared-prefix wait off and on: seconds, engine steps,
and (running, waiting) before each of the first steps.

    python benchmarks/shared_prefix_lang_steps.py [--tokens 4] [--programs 64] [--rounds 2]

One bl.Engine (default model, 1 thread) per setting, one after the other; round 0 starts from an empty cache.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import banyan.lang as bl
from banyan.bench.lang import short
from banyan.frontend.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--programs", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    batch = [{"index": i, "tokens": args.tokens} for i in range(args.programs)]
    for wait in (0, 32):
        engine = bl.Engine(llm=LLM(num_threads=1, shared_prefix_wait_tokens=wait))
        seen: list[tuple[int, int]] = []
        engine.llm.engine.before_step.append(lambda e, seen=seen: seen.append((len(e.scheduler.running),
                                                                    len(e.scheduler.waiting))))
        for r in range(args.rounds):
            seen.clear()
            start = time.perf_counter()
            short.run_batch(batch, temperature=1.0, backend=engine)
            stats = engine.llm.engine.stats()
            print(f"wait={wait} round {r}: {time.perf_counter() - start:.2f} s, {len(seen)} steps, first steps "
                  f"{seen[:6]}, cache hits {stats.prefix_hit_tokens} of {stats.prefix_query_tokens} (running total)")
        engine.close()


if __name__ == "__main__":
    main()

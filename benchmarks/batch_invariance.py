"""What batch-invariant mode costs: the same work with `batch_invariant` off and on, side by side in one process.

    python benchmarks/batch_invariance.py offline [--quantization none] [--rounds 5] [--requests 32]
                                                  [--input-len 128] [--output-len 64]
    python benchmarks/batch_invariance.py prefill [--quantization none] [--rounds 5] [--input-len 1536]

Two engines, one thread each, prefix caching off. Each round sends the same new random prompts to both, alternating
which goes first: `offline` runs a batch of greedy requests to completion (prefill and decode, as `banyan bench
throughput` does), `prefill` one long prompt for one token. Timed in process CPU time, which waiting for a core
does not count (on a shared machine it moves far less than wall time). Prints each round and the median ratio:
throughput on/off (offline) or time on/off (prefill).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from banyan import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("offline", "prefill"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantization", default=None, help="as the flag (default: the model's default)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=32, help="offline: requests a round")
    parser.add_argument("--input-len", type=int, default=None, help="prompt tokens (offline 128, prefill 1536)")
    parser.add_argument("--output-len", type=int, default=64, help="offline: greedy tokens a request")
    args = parser.parse_args()
    offline = args.mode == "offline"
    input_len = args.input_len or (128 if offline else 1536)
    requests, output_len = (args.requests, args.output_len) if offline else (1, 1)
    torch.set_num_threads(1)
    settings = dict(num_threads=1, enable_prefix_caching=False, max_model_len=max(2048, input_len + output_len))
    if args.quantization:
        settings["quantization"] = args.quantization
    engines = {on: LLM(args.model, batch_invariant=on, **settings) for on in (False, True)}
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    rng, ratios = random.Random(0), []
    for r in range(args.rounds):
        prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(input_len)]} for _ in range(requests)]
        seconds = {}
        for on in (False, True) if r % 2 == 0 else (True, False):
            start = time.process_time()
            engines[on].generate(prompts, params, use_tqdm=False)
            seconds[on] = time.process_time() - start
        ratios.append(seconds[False] / seconds[True] if offline else seconds[True] / seconds[False])
        print(f"round {r}: off {seconds[False]:.2f} s, on {seconds[True]:.2f} s CPU, "
              f"{'throughput' if offline else 'time'} on/off {ratios[-1]:.3f}", flush=True)
    what = "throughput" if offline else "time"
    print(f"median {what} on/off {statistics.median(ratios):.3f} over {args.rounds} rounds "
          f"({', '.join(f'{x:.3f}' for x in ratios)}); {torch.backends.cpu.get_cpu_capability()}")


if __name__ == "__main__":
    main()

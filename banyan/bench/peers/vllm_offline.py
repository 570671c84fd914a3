"""Offline generation with vLLM's LLM class, run by vLLM's own python (banyan is not installed there: this file
imports nothing of banyan). usage: python vllm_offline.py JOB.json OUT.json

JOB: {"model": dir, "max_model_len": n, "dtype": "float32", "prompts": [[token ids, output len], ...], "warm_up": [...]}
OUT: {"output_tokens": n, "seconds": s}: every prompt submitted at once, greedy, ignoring EOS; the model's
load and the warm-up prompts are not timed.
"""

import json
import sys
import time


def generate(llm, prompts) -> int:
    from vllm import SamplingParams

    inputs = [{"prompt_token_ids": ids} for ids, _ in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def main(job_path: str, out_path: str) -> None:
    from vllm import LLM

    with open(job_path) as f:
        job = json.load(f)
    length = {"max_model_len": job["max_model_len"]} if job["max_model_len"] else {}
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), **length)
    generate(llm, job["warm_up"])
    start = time.perf_counter()
    tokens = generate(llm, job["prompts"])
    seconds = time.perf_counter() - start
    with open(out_path, "w") as f:
        json.dump({"output_tokens": tokens, "seconds": seconds}, f)


if __name__ == "__main__":  # vLLM's engine starts processes that import this file again
    main(*sys.argv[1:3])

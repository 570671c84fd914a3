"""How long one huge prompt's tokenization stalls the other threads (the server's event loop, /health with it).

A text-pool thread tokenizes `--chars` characters without a space (the soak's text_pool fault, scaled down) while
the main thread sleeps 1 ms at a time; reported per method: the tokenization's seconds and the main thread's
longest wait beyond its 1 ms (the GIL held in one piece: freeing a tokenizers Encoding, building the id lists).
Methods alternate, `--rounds` each; medians. Usage:

    python benchmarks/text_pool_gil.py --tokenizer DIR [--chars 500000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from banyan.text.tokenizer import encode_text, load_tokenizer


def stall_while(fn) -> tuple[float, float]:
    """(seconds fn took in a thread, the longest the main thread waited past a 1 ms sleep meanwhile)."""
    took: list[float] = []

    def run():
        start = time.perf_counter()
        fn()
        took.append(time.perf_counter() - start)

    thread = threading.Thread(target=run)
    longest, start = 0.0, time.perf_counter()
    thread.start()
    while not took:
        asked = time.perf_counter()
        time.sleep(0.001)
        longest = max(longest, time.perf_counter() - asked - 0.001)
    thread.join()
    return took[0], max(longest, time.perf_counter() - start - took[0])  # never woke: the whole call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--chars", type=int, default=500_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    text = "a" * args.chars
    methods = {"tokenizer.encode (transformers)": lambda: tokenizer.encode(text),
               "encode_text (backend, no offsets)": lambda: encode_text(tokenizer, text)}
    assert methods["tokenizer.encode (transformers)"]() == methods["encode_text (backend, no offsets)"]()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, fn in methods.items():
            results[name].append(stall_while(fn))
    print(f"{args.chars:,} characters, {args.rounds} rounds, medians")
    for name, runs in results.items():
        seconds = statistics.median(t for t, _ in runs)
        stall = statistics.median(s for _, s in runs)
        print(f"{name:36s} {seconds:7.2f} s   longest stall of the main thread {1000 * stall:6.0f} ms")


if __name__ == "__main__":
    main()

"""What the examples share: the backend a command line asks for.

    python examples/lang/multi_turn_qa.py                          banyan in process, the default model
    python examples/lang/multi_turn_qa.py --url http://127.0.0.1:8000        a `banyan serve` server
    python examples/lang/multi_turn_qa.py --openai http://127.0.0.1:8000/v1  any OpenAI-compatible server
"""

from __future__ import annotations

import argparse

import banyan.lang as bl


def backend_from_args(description: str) -> bl.Backend:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=None, help="in process: a model path or alias (default: the default model)")
    parser.add_argument("--url", default=None, help="a banyan server's root URL")
    parser.add_argument("--openai", default=None, help="an OpenAI-compatible server's base URL (ending in /v1)")
    parser.add_argument("--served-model", default=None, help="with --openai: the model name to ask for")
    args = parser.parse_args()
    if args.url:
        return bl.RuntimeEndpoint(args.url)
    if args.openai:
        return bl.OpenAICompatible(args.openai, args.served_model)
    return bl.Engine(args.model, num_threads=1, max_model_len=2048)

"""The `banyan` command: generate | chat | serve | bench."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from banyan.bench.cli import add_bench_parser
from banyan.config import ServerConfig
from banyan.config_args import add_config_args, add_engine_args, config_from_args, engine_config
from banyan.errors import BanyanError


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed of each request's sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace):
    from banyan.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from banyan.frontend.llm import LLM

    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("banyan generate: give --prompt TEXT (repeatable) or --prompts-file FILE", file=sys.stderr)
        return 2
    llm = LLM.from_config(engine_config(args))
    params = sampling_params(args)
    start = time.perf_counter()
    if args.raw or llm.tokenizer.chat_template is None:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    else:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        if len(prompts) > 1:
            print(f"### {prompt}")
        print(out.outputs[0].text)
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(
        f"[{len(prompts)} prompts, {prompt_tokens} prompt tokens, {generated} generated tokens in {elapsed:.2f} s: "
        f"{generated / elapsed:.1f} generated tokens/s]",
        file=sys.stderr,
    )
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from banyan.frontend.llm import LLM
    from banyan.text.tokenizer import encode_chat

    llm = LLM.from_config(engine_config(args))
    params = sampling_params(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("banyan chat: type a message; /reset clears the history, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        text, token_ids = encode_chat(llm.tokenizer, history)
        prompt = {"prompt": text, "prompt_token_ids": token_ids}
        reply = []
        for piece in llm.stream(prompt, params):
            reply.append(piece)
            print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from banyan.logs import configure_logging
    from banyan.server.launch import serve
    from banyan.server.model_specs import models_to_serve

    server_config = config_from_args(ServerConfig, args)
    configure_logging(args.log_level, server_config.log_format, role="server")
    if server_config.audit_log:  # one INFO line per request, whatever --log-level says of the rest
        logging.getLogger("banyan.audit").setLevel(logging.INFO)
    specs, routes = models_to_serve(build_parser(), args)
    return asyncio.run(serve(engine_config(args), server_config, fault=args.fault, specs=specs, routes=routes))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="banyan", description="banyan: LLM inference and serving")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete prompts and print the results")
    gen.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = commands.add_parser("chat", help="chat with the model in the terminal, streaming the replies")
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    srv = commands.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_config_args(srv, "server", ServerConfig)
    add_engine_args(srv)
    srv.add_argument("--fault", default=None, help=argparse.SUPPRESS)  # fault injection, for tests only
    srv.set_defaults(func=cmd_serve)

    add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # serve reads each --model's own flags from it
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except BanyanError as e:
        print(f"banyan: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

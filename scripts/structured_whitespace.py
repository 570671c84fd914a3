"""How JSON-schema outputs of the default model end, and where they put whitespace (issue 11, item 3).

    python scripts/structured_whitespace.py                    # 100 answers, the engine's default layout
    python scripts/structured_whitespace.py --disable-any-whitespace false --backend xgrammar

Samples answers at temperature 1.0 (max_tokens 256) under a schema whose strings are bounded and whose
objects are closed, so every answer can finish well within the budget, then counts:
- "stop and valid": finish_reason "stop" and the text parses and validates against the schema;
- "whitespace": answers with any whitespace outside strings (compact JSON, as OpenAI writes it, has none);
- "runs": answers with whitespace other than one space after ':' or ',' (the free-form runs of the issue).
"""

from __future__ import annotations

import argparse
import json
import re
import time

import jsonschema

from banyan import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 32},
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "maxLength": 5},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "address"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a customer of a bakery in JSON.",
    "Give me a made-up person with their address, as JSON.",
    "Return a JSON record for a new library member.",
    "Invent a user profile in JSON.",
]
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def outside_strings(text: str) -> str:
    """The text with every JSON string literal replaced by "" (what is left is structure)."""
    return _STRING.sub('""', text)


def has_whitespace(text: str) -> bool:
    return any(c.isspace() for c in outside_strings(text))


def has_runs(text: str) -> bool:
    """Whitespace other than a single space right after ':' or ','."""
    return bool(re.search(r"\s", re.sub(r"(?<=[:,]) (?=\S)", "", outside_strings(text))))


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answers", type=int, default=100)
    parser.add_argument("--backend", default="llguidance")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--disable-any-whitespace", choices=["true", "false"], default=None,
                        help="set per request (default: leave it to the engine)")
    parser.add_argument("--show", type=int, default=3, help="print this many failing or non-compact answers")
    args = parser.parse_args()

    llm = LLM(num_threads=args.num_threads, structured_output_backend=args.backend, max_model_len=1024)
    spec = {"json": SCHEMA}
    if args.disable_any_whitespace is not None:
        spec["disable_any_whitespace"] = args.disable_any_whitespace == "true"
    conversations = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(args.answers)]
    params = [SamplingParams(temperature=1.0, max_tokens=256, seed=i, structured_outputs=spec)
              for i in range(args.answers)]
    start = time.perf_counter()
    outputs = [o.outputs[0] for o in llm.chat(conversations, params)]
    elapsed = time.perf_counter() - start

    good = [o.finish_reason == "stop" and valid(o.text) for o in outputs]
    spaced = [has_whitespace(o.text) for o in outputs]
    runs = [has_runs(o.text) for o in outputs]
    shown = [o.text for o, g, s in zip(outputs, good, spaced) if not g or s][: args.show]
    for text in shown:
        print(repr(text[:300]))
    print(json.dumps({
        "backend": args.backend, "disable_any_whitespace": args.disable_any_whitespace or "engine default",
        "answers": len(outputs), "stop_and_valid": sum(good), "whitespace_outside_strings": sum(spaced),
        "free_form_runs": sum(runs), "mean_tokens": round(sum(len(o.token_ids) for o in outputs) / len(outputs), 1),
        "seconds": round(elapsed, 1),
    }))


if __name__ == "__main__":
    main()

"""JSON extraction with a schema: the gen is constrained to the schema, so the answer always parses."""

from __future__ import annotations

import json

import banyan.lang as bl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}


@bl.function
def extract(s, text: str, max_tokens: int = 64):
    s += bl.user(f"Extract the person's name, city and age as JSON.\n\nText: {text}")
    s += bl.assistant(bl.gen("person", json_schema=json.dumps(SCHEMA), max_tokens=max_tokens))


def main(backend: bl.Backend, max_tokens: int = 64) -> list[bl.ProgramState]:
    texts = ["Alice is 30 and lives in Paris.", "Bob, 42, moved to Tokyo last year."]
    states = extract.run_batch([{"text": t, "max_tokens": max_tokens} for t in texts], temperature=0, backend=backend)
    for state in states:
        print(json.loads(state["person"]))
    return states


if __name__ == "__main__":
    from common import backend_from_args

    main(backend_from_args(__doc__))

"""The `code-edit` workload of `banyan bench speculative`: "make this change to this code and reply with the whole
code", the kind of request an editor or a coding agent sends, where most of the answer is the given code again.

Nothing is downloaded: the snippets are below, each a small Python module with a name to rename and a variable to
rename, and each prompt is one seeded (snippet, edit) pair, chat-templated. A request stops where the model ends its
answer (not ignore_eos, unlike the copy workload): after a code block the model's own continuation is not part of
the work, and with speculation off and on the greedy tokens are the same, so both sides emit the same tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from banyan.bench.workloads import BenchPrompt
from banyan.text.tokenizer import encode_chat


@dataclass(frozen=True)
class Snippet:
    code: str
    function: str
    """A function the code defines, and the name a rename gives it."""
    renamed: str
    variable: str
    """A local variable of that function, and the name a rename gives it."""
    new_variable: str


SNIPPETS = (
    Snippet('''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
''', "total_price", "order_total", "subtotal", "running_sum"),
    Snippet('''import json


def load_settings(path):
    with open(path) as handle:
        settings = json.load(handle)
    settings.setdefault("timeout", 30)
    settings.setdefault("retries", 3)
    return settings


def save_settings(path, settings):
    with open(path, "w") as handle:
        json.dump(settings, handle, indent=2)
''', "load_settings", "read_config", "settings", "config"),
    Snippet('''def word_counts(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


def most_common(counts, n):
    ranked = sorted(counts.items(), key=lambda pair: pair[1], reverse=True)
    return ranked[:n]
''', "word_counts", "count_words", "counts", "frequencies"),
    Snippet('''class Stack:
    def __init__(self):
        self.items = []

    def push(self, value):
        self.items.append(value)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None
''', "peek", "top", "value", "element"),
    Snippet('''def binary_search(values, target):
    low, high = 0, len(values) - 1
    while low <= high:
        middle = (low + high) // 2
        if values[middle] == target:
            return middle
        if values[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1
''', "binary_search", "find_index", "middle", "mid"),
    Snippet('''def parse_line(line):
    name, age, city = line.strip().split(",")
    return {"name": name, "age": int(age), "city": city}


def read_people(path):
    people = []
    with open(path) as handle:
        for line in handle:
            if line.strip():
                people.append(parse_line(line))
    return people
''', "read_people", "load_people", "people", "records"),
)
"""Small modules to edit: nothing to download, the same on every machine."""

EDITS = (
    "Rename the function {function} to {renamed} everywhere.",
    "Rename the variable {variable} to {new_variable} in the code.",
    "Add a one-line docstring to every function.",
    "Add type hints to the function {function}.",
)
"""The changes asked for, formatted with the snippet's names."""

FORMAT = "Reply with the whole updated code in one Python code block and nothing else.\n\n```python\n{code}```"


def code_edit_prompts(tokenizer, num_prompts: int, *, seed: int = 0, max_tokens: int | None = None) -> list[BenchPrompt]:
    """num_prompts seeded (snippet, edit) requests, chat-templated, every pair once before any repeats; each stops
    where the model ends its answer, or after max_tokens (default: twice its code's tokens, plus 16)."""
    rng = random.Random(seed)
    pairs = [(s, e) for s in SNIPPETS for e in EDITS]
    prompts = []
    for i in range(num_prompts):
        if i % len(pairs) == 0:
            rng.shuffle(pairs)
        snippet, edit = pairs[i % len(pairs)]
        ask = edit.format(**vars(snippet)) + " " + FORMAT.format(code=snippet.code)
        _, ids = encode_chat(tokenizer, [{"role": "user", "content": ask}], add_generation_prompt=True)
        cap = max_tokens or 2 * len(tokenizer.encode(snippet.code)) + 16
        prompts.append(BenchPrompt(ids, cap, ignore_eos=False))
    return prompts

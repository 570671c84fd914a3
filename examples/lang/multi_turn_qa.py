"""Multi-turn question answering: each answer is generated with the conversation so far as its prompt
(the earlier turns come from the prefix cache)."""

from __future__ import annotations

import banyan.lang as bl


@bl.function
def multi_turn_qa(s, questions: list[str], max_tokens: int = 64):
    s += bl.system("You are a helpful assistant. Answer in one or two sentences.")
    for i, question in enumerate(questions):
        s += bl.user(question)
        s += bl.assistant(bl.gen(f"answer_{i}", max_tokens=max_tokens))


def main(backend: bl.Backend, max_tokens: int = 64) -> bl.ProgramState:
    questions = ["What is the capital of France?", "And what river runs through it?"]
    state = multi_turn_qa.run(questions=questions, max_tokens=max_tokens, temperature=0, backend=backend)
    for message in state.messages():
        print(f"{message['role']:>9}: {message['content']}")
    return state


if __name__ == "__main__":
    from common import backend_from_args

    main(backend_from_args(__doc__))

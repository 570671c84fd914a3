"""A tool-using agent loop: each turn the model selects an action (a tool or "answer"); the program runs
the tool in Python and feeds its result back, until the model answers or the turns run out."""

from __future__ import annotations

import ast
import operator

import banyan.lang as bl

TOOLS = ["calculator", "clock", "answer"]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """+ - * / over numbers, evaluated without eval()."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers and + - * /")
    try:
        return str(value(ast.parse(expression.strip(), mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


def clock(_: str) -> str:
    return "12:00"


@bl.function
def agent(s, question: str, max_turns: int = 3, max_tokens: int = 32):
    s += bl.system("You solve tasks with tools. Tools: calculator (arithmetic), clock (the time), "
                   "answer (reply to the user).")
    s += bl.user(question)
    s["actions"] = []
    for turn in range(max_turns):
        s += bl.assistant_begin() + "Action: " + bl.select(f"action_{turn}", choices=TOOLS)
        action = s[f"action_{turn}"]
        s["actions"] = s["actions"] + [action]
        if action == "answer":
            s += "\n" + bl.gen("answer", max_tokens=max_tokens) + bl.assistant_end()
            return
        s += "\nInput: " + bl.gen(f"input_{turn}", max_tokens=max_tokens, stop=["\n"]) + bl.assistant_end()
        result = calculator(s[f"input_{turn}"]) if action == "calculator" else clock(s[f"input_{turn}"])
        s += bl.user(f"Tool result: {result}")
    s += bl.assistant("I could not finish in time.")


def main(backend: bl.Backend, max_tokens: int = 32) -> bl.ProgramState:
    state = agent.run(question="What is 17 * 23?", max_tokens=max_tokens, temperature=0, backend=backend)
    print("actions:", state["actions"])
    print(state.messages()[-1]["content"])
    return state


if __name__ == "__main__":
    from common import backend_from_args

    main(backend_from_args(__doc__))

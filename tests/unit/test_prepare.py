"""Request preparation (banyan/frontend/prepare.py), the one path of the offline LLM and the server:
fan-out ids and seeds, and a chat with tools prepared alike by both."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from banyan.config import EngineConfig, ModelConfig, ServerConfig
from banyan.errors import InvalidParameterError
from banyan.frontend.llm import LLM
from banyan.frontend.prepare import ChatInput, fan_out, prepare_chat
from banyan.request import RequestDelta
from banyan.sampling_params import SamplingParams
from banyan.server import protocol
from banyan.server.generation import Generation
from banyan.server.serving import OpenAIServing
from tests.factories import make_tokenizer, write_model_dir

INT64_MAX = 2**63 - 1
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds", "parameters": ADD}}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]


# -- fan-out ----------------------------------------------------------------------------------------
def test_n_sequences_get_seeds_s_to_s_plus_n_minus_1_and_ids_key_j():
    sequences = fan_out("k", SamplingParams(n=3, seed=7))
    assert [s.request_id for s in sequences] == ["k-0", "k-1", "k-2"]
    assert [s.params.seed for s in sequences] == [7, 8, 9]
    assert all(s.params.n == 1 for s in sequences)


def test_one_sequence_is_the_request_itself():
    params = SamplingParams(seed=7)
    assert [(s.request_id, s.params) for s in fan_out("k", params)] == [("k-0", params)]


def test_best_of_candidates_each_compute_the_logprob_they_are_ranked_by():
    sequences = fan_out("k", SamplingParams(n=1, best_of=3))
    assert len(sequences) == 3
    assert all(s.params.logprobs == 0 and s.params.best_of is None and s.params.seed is None for s in sequences)


def test_seeds_wrap_at_64_bits():
    assert [s.params.seed for s in fan_out("k", SamplingParams(n=2, seed=INT64_MAX))] == [INT64_MAX, -(2**63)]


def test_the_server_names_engine_requests_key_p_j():
    """Two prompts x n=2: choice p * n + j runs as `<http id>.<serial>-<p>-<j>`, seeded s + j."""
    added = []

    class Client:  # each request ends at once, with no tokens
        def open(self, add, sink):
            added.append(add)
            sink(RequestDelta(add.request_id, [], None, 0.0, "length", None, 0))

        def close(self, request_ids):
            pass

    async def run():
        gen = Generation(Client(), make_tokenizer(), "req", [[1, 2], [3]], SamplingParams(n=2, seed=5))
        await gen.run()
        return gen

    gen = asyncio.run(run())
    key = added[0].request_id.rsplit("-", 2)[0]
    assert key.startswith("req.")
    assert [a.request_id for a in added] == [f"{key}-0-0", f"{key}-0-1", f"{key}-1-0", f"{key}-1-1"]
    assert [a.sampling_params.seed for a in added] == [5, 6, 5, 6]
    assert [(c.index, c.request_id) for c in gen.choices] == [(i, a.request_id) for i, a in enumerate(added)]


# -- a chat with tools --------------------------------------------------------------------------------
def make_serving(tokenizer, backend="llguidance") -> OpenAIServing:
    info = SimpleNamespace(max_model_len=256, vocab_size=len(tokenizer), structured_output_backend=backend)
    return OpenAIServing(ServerConfig(), SimpleNamespace(info=info), tokenizer, ["tiny"], metrics=None)


def chat_body(**fields) -> protocol.ChatCompletionRequest:
    return protocol.parse(protocol.ChatCompletionRequest, {"model": "tiny", "messages": MESSAGES, **fields})


@pytest.mark.parametrize("hermes", [False, True], ids=["json_list", "hermes"])
def test_the_server_prepares_a_chat_with_tools_as_the_shared_path_does(hermes):
    tokenizer = make_tokenizer(tool_template=hermes)
    direct = prepare_chat(tokenizer, [MESSAGES], ChatInput(tools=TOOLS, tool_choice="required"), backend="llguidance")
    served = make_serving(tokenizer)._prepare_chat(chat_body(tools=TOOLS, tool_choice="required"))
    assert served.prompts == direct.prompts
    assert served.grammar == direct.grammar is not None
    assert served.calling == direct.calling and direct.calling.fmt.name == ("hermes" if hermes else "json_list")


def test_tool_calling_needs_llguidance_on_both_paths():
    tokenizer = make_tokenizer()
    with pytest.raises(InvalidParameterError, match="llguidance") as e:
        prepare_chat(tokenizer, [MESSAGES], ChatInput(tools=TOOLS), backend="xgrammar")
    assert e.value.param == "tools"
    with pytest.raises(InvalidParameterError, match="llguidance"):
        make_serving(tokenizer, backend="xgrammar")._prepare_chat(chat_body(tools=TOOLS))
    assert prepare_chat(tokenizer, [MESSAGES], ChatInput(tools=TOOLS, tool_choice="none"), backend="xgrammar").grammar is None


def test_a_structured_output_and_tools_are_refused_together_naming_the_field():
    with pytest.raises(InvalidParameterError) as e:
        prepare_chat(make_tokenizer(), [MESSAGES], ChatInput(tools=TOOLS), backend="llguidance", structured_param="response_format")
    assert e.value.param == "response_format"


def test_the_offline_llm_renders_the_prompt_the_server_does(tmp_path):
    write_model_dir(tmp_path, "qwen2", seed=1, tool_template=True)
    llm = LLM.from_config(EngineConfig(model=ModelConfig(str(tmp_path), num_threads=1, max_model_len=512)))
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=1), tools=TOOLS, tool_choice="required", use_tqdm=False)[0]
    served = make_serving(llm.tokenizer)._prepare_chat(chat_body(tools=TOOLS, tool_choice="required"))
    assert out.prompt_token_ids == served.prompts[0][1]
    assert out.prompt == served.prompts[0][0]

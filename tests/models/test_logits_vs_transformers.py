"""banyan's models give transformers' logits on the same tiny random weights.

Each model runs ragged steps over a shuffled paged cache: a prefill of several sequences of different
lengths, a decode step, then a mix of prefill-with-cached-prefix chunks and decode rows. Every row's
logits must match transformers' logits at that position of the full sequence.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from banyan.config import ModelArch
from banyan.errors import ModelLoadError
from banyan.layers.attention import get_attention_backend
from banyan.models.registry import get_model_class
from banyan.registry import UnknownChoiceError
from banyan.forward_batch import ForwardBatch

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=16)
YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16)

CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope-3layers": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=3, rope_parameters=LLAMA3_ROPE)),
    "llama-tied-mha": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters=YARN_ROPE, max_position_embeddings=64)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, num_key_value_heads=1)),
}


def make_hf_model(config_cls: str, arch: str, overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**TINY, **overrides}, architectures=[arch])
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():  # larger-than-default random weights, norms away from 1, so mistakes show
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return model


class PagedSteps:
    """Feeds chunks of several sequences through a banyan model as ragged steps over shuffled pages."""

    def __init__(self, model, arch: ModelArch, page_size: int, num_pages: int = 64, seed: int = 0):
        self.model, self.page_size = model, page_size
        shape = (num_pages, page_size, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_hidden_layers)]
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def make_batch(self, chunks: list[tuple[int, list[int]]]) -> ForwardBatch:
        """chunks: (sequence id, its new tokens); the tokens before them are already cached."""
        ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for seq, tokens in chunks:
            start = self.num_computed.get(seq, 0)
            end = start + len(tokens)
            pages = self.pages.setdefault(seq, [])
            while len(pages) * self.page_size < end:
                pages.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            slots += [pages[p // self.page_size] * self.page_size + p % self.page_size for p in range(start, end)]
            query_lens.append(len(tokens))
            context_lens.append(end)
            self.num_computed[seq] = end
        width = max(len(self.pages[seq]) for seq, _ in chunks)
        tables = [self.pages[seq] + [0] * (width - len(self.pages[seq])) for seq, _ in chunks]
        return ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor(context_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            logits_indices=torch.arange(len(ids)),
            query_lens=query_lens,
            context_lens=context_lens,
            page_size=self.page_size,
        )

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Logits of every new row, split per chunk: [len(tokens), vocab] each."""
        batch = self.make_batch(chunks)
        hidden = self.model(batch, self.kv_caches)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        return list(logits.split(batch.query_lens))


def load_banyan(hf_model):
    arch = ModelArch.from_hf_config(hf_model.config.to_dict())
    model = get_model_class(arch.architecture)(arch, get_attention_backend("torch")).eval()
    model.load_weights(hf_model.state_dict().items())
    return arch, model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name):
    hf = make_hf_model(*CONFIGS[name])
    arch, model = load_banyan(hf)
    gen = torch.Generator().manual_seed(1)
    prompt_lens = [7, 13, 2, 5]
    seqs = [torch.randint(0, arch.vocab_size, (n + 4,), generator=gen).tolist() for n in prompt_lens]
    with torch.no_grad():
        expected = [hf(torch.tensor([s])).logits[0] for s in seqs]  # [len, vocab] per sequence

    for page_size in (4, 16):
        steps = PagedSteps(model, arch, page_size, seed=page_size)
        done = [0] * len(seqs)

        def run(chunk_lens: list[int]):
            chunks = [(i, seqs[i][done[i] : done[i] + n]) for i, n in enumerate(chunk_lens) if n]
            for (i, tokens), logits in zip(chunks, steps.step(chunks)):
                want = expected[i][done[i] : done[i] + len(tokens)]
                torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
                done[i] += len(tokens)

        run(prompt_lens)  # ragged prefill
        run([1, 1, 1, 1])  # decode only
        run([3, 1, 2, 1])  # chunks after a cached prefix, mixed with decode rows
        run([0, 2, 1, 0])  # a subset of the sequences


def test_load_weights_rejects_bad_checkpoints():
    hf = make_hf_model(*CONFIGS["qwen3"])
    arch = ModelArch.from_hf_config(hf.config.to_dict())
    model = get_model_class(arch.architecture)(arch, get_attention_backend("torch"))
    state = dict(hf.state_dict())

    with pytest.raises(ModelLoadError, match="matches no parameter"):
        model.load_weights([*state.items(), ("model.layers.0.self_attn.x_proj.weight", torch.zeros(1))])
    bad = dict(state, **{"model.layers.1.self_attn.k_proj.weight": torch.zeros(3, 64)})
    with pytest.raises(ModelLoadError, match="shape"):
        model.load_weights(bad.items())
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ModelLoadError, match="up_proj"):
        model.load_weights(missing.items())
    untied = {k: v for k, v in state.items() if k != "lm_head.weight"}
    with pytest.raises(ModelLoadError, match="lm_head"):
        model.load_weights(untied.items())
    model.load_weights([*state.items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])

    tied_hf = make_hf_model(*CONFIGS["llama-tied-mha"])
    tied_arch = ModelArch.from_hf_config(tied_hf.config.to_dict())
    tied = get_model_class("LlamaForCausalLM")(tied_arch, get_attention_backend("torch"))
    tied.load_weights((k, v) for k, v in tied_hf.state_dict().items() if k != "lm_head.weight")
    assert torch.equal(tied.lm_head.weight, tied_hf.lm_head.weight)


def test_registry_names_supported_architectures():
    assert get_model_class("MistralForCausalLM").__name__ == "MistralForCausalLM"
    with pytest.raises(UnknownChoiceError, match="architecture: unknown 'GPT2LMHeadModel'; choose from .*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")

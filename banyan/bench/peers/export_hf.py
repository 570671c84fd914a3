"""Write a model banyan can load (an alias, a GGUF file, a directory) as a plain fp32 Hugging Face
directory: config.json, model.safetensors, tokenizer files. GGUF weights come out of banyan's own
loader dequantized, so transformers runs exactly the weights banyan runs, as unpacked tensors.

    python -m banyan.bench.peers.export_hf --model smollm2-135m-instruct   # -> peers_dir()/hf/<name>
"""

from __future__ import annotations

import argparse
from pathlib import Path

from banyan.bench.peers import peers_dir

MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}  # fmt: skip


def hf_dir_for(model: str) -> Path:
    """The directory transformers loads for `model`: the model itself when it is a directory,
    else its export under peers_dir() (which may not exist yet)."""
    if Path(model).is_dir():
        return Path(model)
    return peers_dir() / "hf" / Path(model).name.removesuffix(".gguf")


def export_hf(model: str, out: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from banyan.runner.weights import open_model

    source = open_model(model)
    out.mkdir(parents=True, exist_ok=True)
    hf_config(source.arch).save_pretrained(out)
    weights = {name: t.to(torch.float32).contiguous() for name, t in source.iter_weights()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    source.tokenizer.save_pretrained(out)
    return out


def hf_config(arch):
    """transformers' config for a banyan ModelArch (the fields banyan's models read)."""
    from transformers import AutoConfig

    eos = list(arch.eos_token_ids)
    return AutoConfig.for_model(
        MODEL_TYPES[arch.architecture], architectures=[arch.architecture], vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads, head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta, rope_scaling=arch.rope_scaling, max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings, attention_bias=arch.attention_bias, mlp_bias=arch.mlp_bias,
        hidden_act=arch.hidden_act, bos_token_id=arch.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos,
        sliding_window=arch.sliding_window, dtype="float32",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", default=None, help="default: where `banyan bench compare` looks for it")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else hf_dir_for(args.model)
    if (out / "config.json").is_file():
        print(f"transformers peer: {out} is there already")
        return 0
    print(f"transformers peer: wrote {export_hf(args.model, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

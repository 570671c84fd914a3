"""LoRA adapters: PEFT adapters checked and read (adapter, weights), the resident set (resident), the grouped
low-rank product (grouped) and the wrapped layers (layers). Importing the package loads no torch."""

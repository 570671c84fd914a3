"""The text layer: tokenizers, chat templates, detokenizing and stop strings, user-facing outputs."""

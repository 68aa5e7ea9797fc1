"""Fixtures of the real architecture: tiny random qwen3_5_moe checkpoints in the published layout (tiny) and
a small tokenizer with the real special tokens and chat template (tokenizer). Used by tests, benchmarks and
`quantkit tiny-model`."""

"""Exports other engines load: GGUF (llama.cpp, Ollama, LM Studio) and compressed-tensors (vLLM, SGLang)."""

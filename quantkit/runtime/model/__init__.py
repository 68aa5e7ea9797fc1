"""quantkit's own Qwen3.5-MoE model: the config it reads (`spec`), the hybrid cache (`cache`), the layers' math
(`layers`, `delta_rule`) and the model (`model`). transformers is the reference the tests hold it to, not a
dependency of the runtime."""

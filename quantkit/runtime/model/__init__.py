"""quantkit's own Qwen3.5-MoE model: the config it reads (`config`), the hybrid cache (`cache`), the whole forward
(`qwen3_5_moe`), the ops a step's rows call, chosen once per route (`ops`, `route`), and what runs beside the
layers (`delta_rule`, `experts`, `draft_head`, the one-call executors `executors` and `graph`). transformers is
the reference the tests hold it to, not a dependency of the runtime."""

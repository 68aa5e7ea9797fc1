"""quantkit: plan, quantize and run Qwen-AgentWorld-35B-A3B (qwen3_5_moe) on hardware people own."""

__version__ = "0.1.0"

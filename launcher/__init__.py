"""launch4d: preflight, plan and launch 4D-parallel LLM training."""

__version__ = "0.1.0"

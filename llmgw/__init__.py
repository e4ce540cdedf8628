"""llmgw: turn machines with GPUs into one OpenAI-compatible endpoint."""

__version__ = "0.1.0"

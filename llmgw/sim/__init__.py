"""The simulator engine: a vLLM-like OpenAI server with a paged prefix cache and KV events."""

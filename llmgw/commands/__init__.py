"""Subcommands of the ``llmgw`` CLI, one module each."""

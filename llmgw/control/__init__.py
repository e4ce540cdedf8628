"""The control plane: inventory, reconciler, placement and the agent service."""

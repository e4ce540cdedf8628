"""The agent: discovery, shard supervision, engine event subscriptions and its loop."""

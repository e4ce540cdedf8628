"""The router: replica table, load counters, health, and the decision pipeline over routing tiers."""

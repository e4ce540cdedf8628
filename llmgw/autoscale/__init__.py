"""Autoscaling: replicas that follow demand, decided by the leader from the signals every gateway shares."""

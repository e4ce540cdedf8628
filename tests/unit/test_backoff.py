"""The wait before a supervisor restarts a process."""

from __future__ import annotations

from llmgw.backoff import RestartBackoff


def test_the_delay_doubles_up_to_the_longest_and_starts_over_after_a_stable_run():
    backoff = RestartBackoff(0.5, 3.0, stable_after=60.0)
    assert [backoff.next_delay(1.0) for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff.next_delay(None) == 3.0  # a failed start is no recovery
    assert backoff.next_delay(60.0) == 0.5  # it ran for a minute: a new crash starts the series again
    assert backoff.next_delay(0.1) == 1.0

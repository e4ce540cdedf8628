"""A stream's doorbell on a Redis that refuses CLIENT TRACKING (an ACL user without it) never ends its process.

A gateway's doorbells are cancelled whenever what they serve stops (the log's follower at each term this
process wins). When Redis's refusal reached a doorbell in the same step as its cancellation, the refusal came
out of the Redis client's nursery in one group with the Cancelled, the doorbell's handler took it for a
cancellation, and the refusal went on up to end the gateway (exit code 1, one cluster start-up in four).

Real ``redis-server`` and the real doorbell; the cancellation is put before each of the doorbell task's steps in
turn, from its first to the one where Redis's refusal reaches it, so the step where both arrive together is
always among them.
"""

from __future__ import annotations

import logging

import coredis
import trio
import trio.lowlevel

from llmgw.cluster.records import Keys
from llmgw.cluster.streams import Doorbell
from llmgw.config.loading import parse_config
from llmgw.testing.shared_state import state_section

PASSWORD_ENV = "TEST_DOORBELL_REDIS_PASSWORD"
PASSWORD = "a password of the test"
REFUSED = "refused client tracking"


class CancelBeforeStep(trio.abc.Instrument):
    """Cancels ``scope`` just before ``task`` runs its ``step``-th step (counted from 1 once it is set)."""

    def __init__(self, scope: trio.CancelScope, step: int):
        self.scope = scope
        self.step = step
        self.task: trio.lowlevel.Task | None = None
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1
            if self.steps == self.step:
                self.scope.cancel()


async def test_a_doorbell_cancelled_as_redis_refuses_tracking_ends_by_its_cancellation(
        private_redis, cluster_name, monkeypatch, caplog):
    host, port = private_redis.url.removeprefix("redis://").split("/")[0].split(":")
    async with coredis.Redis(host=host, port=int(port)) as redis:
        await redis.acl_setuser("llmgw", "on", f">{PASSWORD}", "~*", "&*", "+@all", "-client")
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    settings = parse_config(state_section(private_redis.url, cluster_name, username="llmgw",
                                          password_env=PASSWORD_ENV)).state
    key = Keys(cluster_name).load
    caplog.set_level(logging.WARNING, logger="llmgw.cluster.streams")
    step = 0
    while not any(REFUSED in record.getMessage() for record in caplog.records):
        step += 1
        assert step < 1000, "the doorbell never got to Redis's refusal"
        doorbell = Doorbell(settings, key)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:  # the doorbell's error, if any, fails the test here
                instrument = CancelBeforeStep(nursery.cancel_scope, step)

                async def ring() -> None:
                    instrument.task = trio.lowlevel.current_task()
                    await doorbell.run()

                trio.lowlevel.add_instrument(instrument)
                try:
                    nursery.start_soon(ring)
                    await trio.sleep_forever()
                finally:
                    trio.lowlevel.remove_instrument(instrument)
    assert step > 1
    told = [record for record in caplog.records if REFUSED in record.getMessage()]
    assert len(told) == 1 and key in told[0].getMessage(), [r.getMessage() for r in told]

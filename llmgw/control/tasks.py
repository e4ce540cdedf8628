"""A control-plane service whose background tasks live in the nursery its :meth:`TaskHost.run` owns."""

from __future__ import annotations

import trio


class TaskHost:
    """Start it with ``await nursery.start(host.run)``; then :meth:`spawn` runs tasks until that nursery ends."""

    _nursery: trio.Nursery | None = None
    not_running = "the service is not running"  # the assertion's message when spawn() is called before run()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the service's background tasks."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None  # before the nursery closes to new arrivals: spawn() is refused from now on
                self.stopping()

    def stopping(self) -> None:
        """The service is being cancelled: its tasks are about to be (a subclass says why, to them or the log)."""

    @property
    def running(self) -> bool:
        """Whether :meth:`spawn` may be called: from :meth:`run`'s start until it is cancelled."""
        return self._nursery is not None

    def spawn(self, fn, *args) -> None:
        assert self._nursery is not None, self.not_running
        self._nursery.start_soon(fn, *args)

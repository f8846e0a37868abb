"""The engine's futures awaited on the event loop, their results handed over in batches: a
forward answers its requests together, on another thread, and the loop is woken once for
all of them instead of once each (asyncio.wrap_future writes to the loop's wake-up pipe for
every future)."""
import asyncio
import concurrent.futures
import threading


class LoopFutures:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._done: list[tuple[concurrent.futures.Future, asyncio.Future]] = []

    def wrap(self, future: concurrent.futures.Future) -> asyncio.Future:
        """An asyncio future of the loop that takes `future`'s result, exception or
        cancellation. Cancelling it does not cancel `future`."""
        waiting = self._loop.create_future()
        future.add_done_callback(lambda done: self._arrived(done, waiting))
        return waiting

    def _arrived(self, future: concurrent.futures.Future, waiting: asyncio.Future) -> None:
        with self._lock:
            self._done.append((future, waiting))
            first = len(self._done) == 1
        if first and not self._loop.is_closed():  # later ones find the loop already woken
            self._loop.call_soon_threadsafe(self._settle)

    def _settle(self) -> None:
        with self._lock:
            done, self._done = self._done, []
        for future, waiting in done:
            if waiting.done():  # cancelled: nobody waits for it
                continue
            if future.cancelled():
                waiting.cancel()
            elif (error := future.exception()) is not None:
                waiting.set_exception(error)
            else:
                waiting.set_result(future.result())

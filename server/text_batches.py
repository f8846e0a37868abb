"""Text score requests tokenized and submitted off the event loop in batches
(Engine.submit_all): one batch at a time on a worker thread, one call of the tokenizer's batch
encoding for each. The requests of a turn of the event loop make a batch; those that arrive
while one is being tokenized wait for it and go together in the next, so that batches grow
with the load instead of the hops to worker threads."""
import asyncio
import concurrent.futures
from typing import Callable

from runtime.request import ScoreRequest

SubmitAll = Callable[[list[ScoreRequest]], list[concurrent.futures.Future]]


class TextBatches:
    def __init__(self, submit_all: SubmitAll):
        self._submit_all = submit_all
        self._pending: list[tuple[ScoreRequest, asyncio.Future]] = []
        self._running = False  # a batch is with the worker thread

    def submit(self, req: ScoreRequest) -> asyncio.Future:
        """Resolves to the engine's future for `req` (or raises its ScoreError) once its
        batch is submitted."""
        loop = asyncio.get_running_loop()
        if not self._pending and not self._running:
            loop.call_soon(self._flush, loop)
        submitted = loop.create_future()
        self._pending.append((req, submitted))
        return submitted

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending, []
        done = loop.run_in_executor(None, self._submit_all, [req for req, _ in batch])
        self._running = True
        done.add_done_callback(lambda _: self._finished(loop, batch, done))

    def _finished(self, loop: asyncio.AbstractEventLoop, batch, done: asyncio.Future) -> None:
        self._running = False
        _settle(batch, done)
        if self._pending:
            self._flush(loop)


def _settle(batch: list[tuple[ScoreRequest, asyncio.Future]], done: asyncio.Future) -> None:
    if done.cancelled() or done.exception() is not None:  # a bug, or the loop stopping
        error = done.exception() if not done.cancelled() else asyncio.CancelledError()
        for _, submitted in batch:
            if not submitted.done():
                submitted.set_exception(error)
        return
    for (_, submitted), future in zip(batch, done.result(), strict=True):
        if submitted.done():  # its request was cancelled meanwhile: nobody waits for it
            future.cancel()
        else:
            submitted.set_result(future)

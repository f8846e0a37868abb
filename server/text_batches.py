"""Text score requests that arrive in one turn of the event loop, tokenized and submitted
together off it (Engine.submit_all): one hop to a worker thread and one call of the
tokenizer's batch encoding for them all, instead of one each."""
import asyncio
import concurrent.futures
from typing import Callable

from runtime.request import ScoreRequest

SubmitAll = Callable[[list[ScoreRequest]], list[concurrent.futures.Future]]


class TextBatches:
    def __init__(self, submit_all: SubmitAll):
        self._submit_all = submit_all
        self._pending: list[tuple[ScoreRequest, asyncio.Future]] = []

    def submit(self, req: ScoreRequest) -> asyncio.Future:
        """Resolves to the engine's future for `req` (or raises its ScoreError) once the
        requests of this turn of the loop are submitted."""
        loop = asyncio.get_running_loop()
        if not self._pending:
            loop.call_soon(self._flush, loop)
        submitted = loop.create_future()
        self._pending.append((req, submitted))
        return submitted

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending, []
        done = loop.run_in_executor(None, self._submit_all, [req for req, _ in batch])
        done.add_done_callback(lambda _: _settle(batch, done))


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

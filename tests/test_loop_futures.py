"""The engine's futures on the event loop: results, errors and cancellations handed over, and
the loop woken once for the results that arrive together."""
import asyncio
import concurrent.futures
import threading

import pytest

from runtime.errors import ScoreError
from server.loop_futures import LoopFutures


def test_results_that_arrive_together_wake_the_loop_once():
    async def main():
        loop = asyncio.get_running_loop()
        wakes, wake = [], loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: (wakes.append(args), wake(*args))[1]
        results = LoopFutures(loop)
        futures = [concurrent.futures.Future() for _ in range(20)]
        waiting = [results.wrap(future) for future in futures]
        answer = threading.Thread(target=lambda: [f.set_result(k) for k, f in enumerate(futures)])
        answer.start()
        answer.join()  # the loop runs nothing meanwhile: all 20 arrive before it wakes
        assert await asyncio.gather(*waiting) == list(range(20))
        assert len(wakes) == 1
        later = concurrent.futures.Future()
        waiting = results.wrap(later)
        threading.Thread(target=later.set_result, args=("next",)).start()
        assert await waiting == "next"
        assert len(wakes) == 2  # one forward's results after another's: woken again

    asyncio.run(main())


def test_errors_cancellations_and_futures_already_done_are_handed_over():
    async def main():
        loop, errors = asyncio.get_running_loop(), []
        loop.set_exception_handler(lambda _, context: errors.append(context))
        results = LoopFutures(loop)
        failed, cancelled, done, unwanted = (concurrent.futures.Future() for _ in range(4))
        done.set_result(7)
        waiting = [results.wrap(f) for f in (failed, cancelled, done, unwanted)]
        waiting[3].cancel()  # its client went away before its result came
        failed.set_exception(ScoreError("bad request"))
        cancelled.cancel()
        unwanted.set_result(1)
        with pytest.raises(ScoreError, match="bad request"):
            await waiting[0]
        with pytest.raises(asyncio.CancelledError):
            await waiting[1]
        assert await waiting[2] == 7
        await asyncio.sleep(0)
        assert waiting[3].cancelled() and not unwanted.cancelled()
        assert errors == []  # settling the unwanted result raised nothing

    asyncio.run(main())

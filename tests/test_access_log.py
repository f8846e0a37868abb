"""The access log: absl's line format, one write for the lines of a turn of the event loop,
and a broken stream that costs no request."""
import asyncio
import io
import logging
import re

from absl import logging as absl_logging

from server.access_log import AccessLog


class CountingStream(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = 0

    def write(self, text):
        self.writes += 1
        return super().write(text)


def test_a_turns_lines_go_out_in_one_write_in_absls_format():
    stream = CountingStream()

    async def main():
        log = AccessLog(lambda: stream)
        for k in range(20):  # the answers of one forward
            log.line(f"request {k}")
        assert stream.writes == 0  # kept until the loop's next turn
        await asyncio.sleep(0)
        log.line("request 20")
        await asyncio.sleep(0)

    asyncio.run(main())
    lines = stream.getvalue().splitlines()
    assert stream.writes == 2 and [line.rsplit(" ", 1)[1] for line in lines] == [
        str(k) for k in range(21)]
    record = logging.LogRecord("absl", logging.INFO, "access_log.py", 1, "", None, None)
    absl_prefix = absl_logging.get_absl_log_prefix(record)  # absl's own, for its shape
    shape = r"I\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ access_log\.py:\d+\] "
    assert re.match(shape, absl_prefix)
    assert all(re.fullmatch(shape + r"request \d+", line) for line in lines), lines


def test_a_broken_stream_loses_its_lines_and_raises_nothing():
    broken, mended = io.StringIO(), io.StringIO()
    broken.close()
    streams = [broken, mended]

    async def main():
        log = AccessLog(lambda: streams[0])
        log.line("lost")
        log.flush()  # its write fails within, raising nothing here
        await asyncio.sleep(0)
        streams.pop(0)
        log.line("kept")
        await asyncio.sleep(0)

    asyncio.run(main())
    assert [line.rsplit(" ", 1)[1] for line in mended.getvalue().splitlines()] == ["kept"]

"""A ModelRunner wrapper for fault, cancellation and pipeline tests."""
import threading


class GatedRunner:
    """Wraps runner.dispatch and runner.collect: holds each forward's dispatch until released,
    records its rows and the order of dispatches and collects, and fails chosen forwards
    where a device fault shows, when their results are collected."""

    def __init__(self, runner, monkeypatch, fail=lambda call: False):
        self.real_dispatch, self.real_collect, self.fail = runner.dispatch, runner.collect, fail
        self.entered, self.release = threading.Event(), threading.Event()
        self.rows, self.events = [], []
        self._calls = {}  # the pending outputs of a dispatch -> its call number
        monkeypatch.setattr(runner, "dispatch", self.dispatch)
        monkeypatch.setattr(runner, "collect", self.collect)

    def dispatch(self, batch, shape):
        call = len(self.rows)
        self.rows.append(int(batch.num_rows))
        self.entered.set()
        assert self.release.wait(60)
        pending = self.real_dispatch(batch, shape)
        self._calls[id(pending)] = call
        self.events.append(f"dispatch {call}")
        return pending

    def collect(self, pending):
        call = self._calls.pop(id(pending))
        self.events.append(f"collect {call}")
        result = self.real_collect(pending)
        if self.fail(call):
            raise RuntimeError(f"injected fault in forward {call}")
        return result

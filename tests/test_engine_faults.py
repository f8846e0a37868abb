"""A failed forward fails only its own request and leaks nothing."""
import pytest

from runtime.engine import Engine, EngineConfig


@pytest.fixture
def engine(model_dirs) -> Engine:
    return Engine.from_path(model_dirs["qwen3"], EngineConfig(page_size=8, max_batch_tokens=64,
                                                              max_seqs=4))


def test_failure_after_cache_donation_does_not_break_later_requests(engine, monkeypatch):
    want = engine.score("a query", ["x", "yz"], [1, 2]).scores
    real_step = engine._step

    def failing_step(params, cache, batch, **kw):
        cache.k.delete()  # what a device fault after donation leaves behind
        cache.v.delete()
        raise RuntimeError("device fault")

    monkeypatch.setattr(engine, "_step", failing_step)
    with pytest.raises(RuntimeError, match="device fault"):
        engine.score("a query", ["x", "yz"], [1, 2])
    assert engine.pages.free_count == engine.pages.num_pages
    monkeypatch.setattr(engine, "_step", real_step)
    assert engine.score("a query", ["x", "yz"], [1, 2]).scores == want


def test_page_shortage_returns_pages_taken(engine, monkeypatch):
    real_allocate = engine.pages.allocate
    calls = []

    def allocate_then_fail(count):
        if calls:
            raise MemoryError("pool exhausted")
        calls.append(count)
        return real_allocate(count)

    monkeypatch.setattr(engine.pages, "allocate", allocate_then_fail)
    with pytest.raises(MemoryError):
        engine.score("q", ["a", "b"], [1], item_first=True)
    assert engine.pages.free_count == engine.pages.num_pages

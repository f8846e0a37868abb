import numpy as np


def assert_scores_close(got, want, atol: float = 1e-5, rtol: float = 0.0) -> None:
    """Scores within `atol` (+ `rtol`, for unbounded classifier logits); positive ones also
    within 1e-5 relative in log space, so that tiny probabilities are compared too. Also the
    tolerance for one prompt scored in two forwards of different shapes (with the query's KV
    cached, or other prompts beside it): XLA's CPU dots round differently by shape, by up to
    2e-5 in log score on the tiny models (multi-item against one-by-one, 2026-11-25)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)
    if (want > 0).all() and (got > 0).all():
        np.testing.assert_allclose(np.log(got), np.log(want), rtol=1e-5, atol=atol)


def assert_no_leaked_pages(engine) -> None:
    """Every page is held by its holders only; with the prefix cache flushed, all are free."""
    engine.check_pages()
    engine.flush_prefix_cache()
    engine.check_pages()
    for scheduler in engine.schedulers:
        assert scheduler.pool.free_count == scheduler.pool.num_pages

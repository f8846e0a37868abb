import numpy as np

# Positive scores (probabilities) are compared in log space: within 1e-5 relative and this
# much absolute. XLA's CPU dots round by the shape of the forward, so one prompt scored in two
# forwards of different shapes (beside other prompts, or after its query's KV was cached) moves
# by up to 1.9e-5 in log score on the tiny models (multi-item against one-by-one, 2026-11-25,
# on two EPYCs; 1.8e-5 between 64 concurrent requests and each alone), more than the 1e-5 this
# was before: twice the largest seen.
LOG_SCORE_ATOL = 4e-5


def assert_scores_close(got, want, atol: float = 1e-5, rtol: float = 0.0) -> None:
    """Probabilities within LOG_SCORE_ATOL in log score (1e-5 relative besides), so that tiny
    ones are compared to their digits and large ones within about 4e-5; other scores
    (classifier logits, zeros) within `atol` (+ `rtol`, for unbounded logits). Never bit for
    bit: see LOG_SCORE_ATOL."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    if (want > 0).all() and (got > 0).all():
        np.testing.assert_allclose(np.log(got), np.log(want), rtol=1e-5,
                                   atol=max(atol, LOG_SCORE_ATOL))
    else:
        np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)


def assert_no_leaked_pages(engine) -> None:
    """Every page is held by its holders only; with the prefix cache flushed, all are free."""
    engine.check_pages()
    engine.flush_prefix_cache()
    engine.check_pages()
    for status in engine.statuses():
        assert status.kv_pages_free == status.kv_pages

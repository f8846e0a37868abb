"""Compiled programs kept between starts (runtime.program_cache): found again without
compiling, scoring exactly as compiled ones, and never found for another program."""
import os

import pytest

from runtime.engine import Engine
from tests.tiny_models import small_config

QUERY, ITEMS, LABELS = [3, 9, 27, 81, 5, 7, 11], [[1, 2], [4], [8, 16, 32]], [5, 17]
# Each test starts from an empty JAX compilation cache: its first engine compiles (and keeps)
# its programs, rather than reading the session's cache (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("empty_xla_cache")


def scores_twice(engine: Engine):
    """A request, then one that reads its query's KV from the prefix cache."""
    first = engine.score(QUERY, ITEMS, LABELS).scores
    return first, engine.score(QUERY, ITEMS[::-1], LABELS).scores


def test_a_second_engine_reads_the_programs_back_and_scores_alike(model_dirs, tmp_path):
    config = small_config(program_cache_dir=str(tmp_path))
    engine = Engine.from_path(model_dirs["qwen3"], config)
    want = scores_twice(engine)
    engine.close()
    stored = len(os.listdir(tmp_path))
    assert stored == engine.runner.compile_count > 0
    engine = Engine.from_path(model_dirs["qwen3"], config)
    got = scores_twice(engine)
    engine.close()
    assert engine.runner.compile_count == 0 and got == want  # bit for bit
    assert len(os.listdir(tmp_path)) == stored


def test_another_program_is_never_found(model_dirs, tmp_path, monkeypatch):
    engine = Engine.from_path(model_dirs["qwen3"], small_config(program_cache_dir=str(tmp_path)))
    scores_twice(engine)
    engine.close()
    other = Engine.from_path(model_dirs["qwen3"], small_config(
        program_cache_dir=str(tmp_path), max_rows=16))  # other buckets
    other.score(QUERY, ITEMS, LABELS)
    other.close()
    assert other.runner.compile_count > 0
    monkeypatch.setattr("runtime.program_cache.source_digest", lambda: "edited source")
    edited = Engine.from_path(model_dirs["qwen3"], small_config(program_cache_dir=str(tmp_path)))
    edited.score(QUERY, ITEMS, LABELS)
    edited.close()
    assert edited.runner.compile_count > 0


def test_a_damaged_entry_is_compiled_again(model_dirs, tmp_path):
    config = small_config(program_cache_dir=str(tmp_path))
    engine = Engine.from_path(model_dirs["qwen3"], config)
    want = engine.score(QUERY, ITEMS, LABELS).scores
    engine.close()
    for name in os.listdir(tmp_path):
        (tmp_path / name).write_bytes(b"not a program")
    engine = Engine.from_path(model_dirs["qwen3"], config)
    assert engine.score(QUERY, ITEMS, LABELS).scores == want
    engine.close()
    assert engine.runner.compile_count == 1


def test_a_program_from_jax_compilation_cache_is_not_kept(model_dirs, tmp_path):
    """As after an upgrade of the package: the program cache misses (other source), JAX's
    cache has the programs. XLA CPU serializes a program read from JAX's cache without its
    fused kernels, so that, kept, it failed every forward of the next start."""
    engine = Engine.from_path(model_dirs["qwen3"], small_config())  # fills JAX's cache
    want = scores_twice(engine)
    engine.close()
    for start in range(2):
        engine = Engine.from_path(model_dirs["qwen3"],
                                  small_config(program_cache_dir=str(tmp_path)))
        got = scores_twice(engine)
        engine.close()
        assert got == want, start
        programs = engine.runner.programs
        assert programs.xla_cache_hit_count == programs.compile_count > 0
    assert os.listdir(tmp_path) == []

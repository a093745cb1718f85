"""What the CPU can check of compiling Triton kernels ahead (``nvray/worker/compile_ahead.py``):
the thread setting, and that nothing is attempted where it does not apply. The compiles
themselves need a GPU: ``tests/gpu/test_compile_ahead_gpu.py``."""

from __future__ import annotations

import pytest

from nvray.worker import compile_ahead


@pytest.mark.parametrize("raw, threads", [("0", 0), ("off", 0), ("false", 0), ("3", 3)])
def test_the_thread_setting_is_read_from_the_environment(monkeypatch, raw, threads):
    monkeypatch.setenv("NVRAY_COMPILE_AHEAD", raw)
    assert compile_ahead.compile_threads() == threads


def test_by_default_it_uses_up_to_eight_threads(monkeypatch):
    monkeypatch.delenv("NVRAY_COMPILE_AHEAD", raising=False)
    assert 1 <= compile_ahead.compile_threads() <= 8


def test_a_bad_thread_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("NVRAY_COMPILE_AHEAD", "lots")
    with pytest.raises(ValueError, match="NVRAY_COMPILE_AHEAD='lots'"):
        compile_ahead.compile_threads()


def test_nothing_compiles_ahead_on_the_cpu_or_under_the_interpreter(monkeypatch):
    monkeypatch.delenv("NVRAY_COMPILE_AHEAD", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert compile_ahead.ahead_threads("cpu") == 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert compile_ahead.ahead_threads("cuda") == 0


def test_a_cpu_engine_start_has_no_compile_ahead_phase(tiny_path):
    from nvray import LLM

    llm = LLM(tiny_path, runtime="inprocess", max_model_len=128)
    try:
        assert "compile_ahead" not in llm.engine.startup["phases_s"]
        assert "kv_cache" in llm.engine.startup["phases_s"]
    finally:
        llm.shutdown()

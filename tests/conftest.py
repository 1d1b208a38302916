import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)


@pytest.fixture
def require_unilab():
    """UniLab 1.5.2's learner; CI sets FLASHSAC_REQUIRE_UNILAB=1 so a missing install fails."""
    try:
        import unilab.rl.algos.flash_sac.learner  # noqa: F401
    except ImportError as exc:
        if os.environ.get("FLASHSAC_REQUIRE_UNILAB") == "1":
            pytest.fail(f"UniLab is required here but not importable: {exc}")
        pytest.skip("UniLab 1.5.2 not installed (pip install 'flashsac-opt[unilab]')")

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/unilab_tree.py
# Without CUDA the fused Triton kernels (tests/test_kernels.py) run in Triton's interpreter. Triton
# reads the switch when it is first imported, which any test module may do first, so it is set
# here, before all of them. Nothing else on the CPU runs Triton (Inductor generates C++ there).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Scalar C++ kernels for Inductor's CPU compiles: the suite checks what is compiled and that it agrees
# with eager, not the CPU's vector units. A cold compile of a whole learner's steps took 93 s
# vectorized and 47 s scalar on a 2-core machine (test_inductor_compile_matches_eager_cpu, 2026-12-07),
# and CI had grown past 12 minutes. Inherited by every process a test starts; an exported value wins.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# The suite's own Inductor cache, made by the controller and inherited by its xdist workers and the
# processes they start: a kernel compiles once per run, never from or into another run's cache on
# the machine (a UniLab training compiling the same kernel beside the suite had it read a half-written
# .so, "file too short", 2026-12-04), and the suite's time is a cold run's. An exported
# TORCHINDUCTOR_CACHE_DIR wins; tests that need an empty cache set their own.
if "PYTEST_XDIST_WORKER" not in os.environ and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _inductor_cache = tempfile.mkdtemp(prefix="flashsac_opt_tests_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache
    atexit.register(shutil.rmtree, _inductor_cache, ignore_errors=True)
# pytest-xdist workers share the machine's cores: each worker's torch, and every process it
# starts (UniLab trainings, compile-ahead children), gets its share of intra-op threads. With
# torch's default (every core in every worker) two workers on CI's two cores spin against each
# other: the four oracle comparisons had not finished in 600 s in two workers; 68 s with one thread each
# (2026-12-04, a 2-core CPU machine).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Compile ahead (background by default for a compiled learner on CUDA) would make every GPU test
# of the adapter defer its compile to a child: the tests that exercise it set the switch
# themselves; the rest test the compile in prepare_for_collection.
os.environ.setdefault("FLASHSAC_OPT_COMPILE_AHEAD", "0")


@pytest.fixture(autouse=True, scope="session")
def private_compile_cache_dir(tmp_path_factory):
    """UniLab runs default to the keyed compile-cache file (adapter.unilab_compile_cache_file):
    keep the tests' files out of the home directory."""
    previous = os.environ.get("FLASHSAC_OPT_CACHE_DIR")
    os.environ["FLASHSAC_OPT_CACHE_DIR"] = str(tmp_path_factory.mktemp("flashsac_opt_cache"))
    yield
    if previous is None:
        os.environ.pop("FLASHSAC_OPT_CACHE_DIR", None)
    else:
        os.environ["FLASHSAC_OPT_CACHE_DIR"] = previous


def pytest_collection_modifyitems(config, items):
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
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


@pytest.fixture
def site(tmp_path, require_unilab):
    """A private copy of the installed UniLab 1.5.2 (package + dist-info) to patch freely."""
    from unilab_tree import copy_unilab

    return copy_unilab(tmp_path / "site")

"""flashsac_opt/unilab/host_cpus.py: the collector's CPUs (whole physical cores spared for the learner
process) and blocking-sync scheduling of the CUDA primary contexts (CPU; one GPU test)."""

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from flashsac_opt.unilab import host_cpus


def fake_sysfs(tmp_path, siblings: dict[int, str]):
    for cpu, text in siblings.items():
        folder = tmp_path / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(text + "\n")
    return tmp_path


def test_spared_cpus_are_whole_physical_cores_from_the_top(tmp_path):
    # 4 cores, 2 threads each: siblings (0, 4), (1, 5), (2, 6), (3, 7), as Linux numbers them
    sysfs = fake_sysfs(tmp_path, {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
    assert host_cpus.physical_cores(set(range(8)), sysfs) == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]
    assert host_cpus.collector_cpus(set(range(8)), 2, sysfs) == ({0, 1, 2, 4, 5, 6}, {3, 7})
    assert host_cpus.collector_cpus(set(range(8)), 3, sysfs) == ({0, 1, 4, 5}, {2, 3, 6, 7})  # never half a core
    assert host_cpus.collector_cpus(set(range(8)), 100, sysfs) == ({0, 4}, {1, 2, 3, 5, 6, 7})  # one core stays
    assert host_cpus.collector_cpus(set(range(8)), 0, sysfs) == (set(range(8)), set())
    # only the CPUs this process may use count, and a sibling outside them is not taken
    assert host_cpus.collector_cpus({0, 1, 2, 4}, 1, sysfs) == ({0, 1, 4}, {2})
    with pytest.raises(ValueError, match="must be >= 0"):
        host_cpus.collector_cpus(set(range(8)), -1, sysfs)


def test_cpus_without_a_readable_topology_are_cores_of_their_own(tmp_path):
    assert host_cpus.physical_cores({0, 1, 2}, tmp_path / "missing") == [{0}, {1}, {2}]
    assert host_cpus.collector_cpus({0, 1, 2}, 1, tmp_path / "missing") == ({0, 1}, {2})


def test_the_switch_is_read_as_a_whole_number(monkeypatch):
    monkeypatch.delenv(host_cpus.SPARE_ENV, raising=False)
    assert host_cpus.spare_cpus_from_env() == 0 and host_cpus.confine_collector() is None  # off: nothing changes
    monkeypatch.setenv(host_cpus.SPARE_ENV, "two")
    with pytest.raises(ValueError, match="whole number of CPUs, got 'two'"):
        host_cpus.spare_cpus_from_env()
    # at launch, in the training process (patch 0005's hook), before any process is started
    from flashsac_opt.unilab import collector_start

    monkeypatch.setattr(collector_start, "_context", None)
    with pytest.raises(ValueError, match="FLASHSAC_OPT_COLLECTOR_SPARE_CPUS must be a whole number"):
        collector_start.start_preload()
    assert collector_start._context is None  # no server started


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to spare")
def test_confining_a_process_changes_its_own_affinity_only():
    code = ("import json, os; from flashsac_opt.unilab import host_cpus; r = host_cpus.confine_collector(); "
            "print(json.dumps([r, sorted(os.sched_getaffinity(0))]))")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **{host_cpus.SPARE_ENV: "1"}),
                         capture_output=True, text=True, timeout=120, check=True).stdout
    report, affinity = __import__("json").loads(out)
    assert report["spared_cpus"] and affinity == report["collector_cpus"]
    assert set(affinity) | set(report["spared_cpus"]) == os.sched_getaffinity(0)


class FakeDriver:
    """The five driver entry points set_blocking_sync calls, over two devices whose primary contexts
    carry CU_CTX_SCHED_SPIN (1) and CU_CTX_LMEM_RESIZE_TO_MAX (0x10)."""

    def __init__(self, set_status=0):
        self.set_status, self.set_calls = set_status, []

    def cuInit(self, flags):
        return 0

    def cuDeviceGetCount(self, count):
        count._obj.value = 2
        return 0

    def cuDeviceGet(self, device, ordinal):
        device._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxGetState(self, device, flags, active):
        flags._obj.value, active._obj.value = 0x11, 0
        return 0

    def cuDevicePrimaryCtxSetFlags(self, device, flags):
        self.set_calls.append((device.value, flags.value))
        return self.set_status


def test_blocking_sync_replaces_the_scheduling_bits_only_and_reports_a_refusal():
    driver = FakeDriver()
    assert host_cpus.set_blocking_sync(driver) == "blocking sync set on device(s) [0, 1]"
    assert driver.set_calls == [(0, 0x14), (1, 0x14)]  # LMEM_RESIZE_TO_MAX kept, SPIN replaced by BLOCKING_SYNC
    refused = host_cpus.set_blocking_sync(FakeDriver(set_status=708))
    assert "returned 708" in refused and "device 0" in refused


@pytest.mark.skipif(host_cpus._driver() is not None, reason="a CUDA driver is installed here")
def test_without_a_driver_nothing_is_set():
    assert host_cpus.set_blocking_sync() == "no CUDA driver: nothing set"
    assert host_cpus.primary_context_schedule() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_blocking_sync_holds_for_the_context_torch_creates_after_it():
    code = ("from flashsac_opt.unilab import host_cpus; import torch; said = host_cpus.set_blocking_sync(); "
            "x = torch.ones(1000, device='cuda').sum(); torch.cuda.synchronize(); "
            "print(said, '|', host_cpus.primary_context_schedule(torch.cuda.current_device()), float(x))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    said, numbers = out.strip().rsplit("|", 1)
    assert said.startswith("blocking sync set on device(s)")
    assert numbers.split() == [str(host_cpus.CU_CTX_SCHED_BLOCKING_SYNC), "1000.0"]

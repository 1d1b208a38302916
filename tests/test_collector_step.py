"""experiments/bench/collector_step.py: UniLab's G1 env stepped without a learner, its step phases
per collector tensor carrier (CPU here; the CUDA carrier needs a GPU and is reported as skipped)."""

import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "bench" / "collector_step.py"


def test_the_probe_reports_unilabs_step_phases_per_carrier(tmp_path, require_unilab):
    out = tmp_path / "collector_step.json"
    # a subprocess: the probe imports a private UniLab copy in place of the installed one; eager, so
    # CI's empty Inductor cache does not build UniLab's compiled reset in C++ (~15 s here)
    subprocess.run([sys.executable, str(SCRIPT), "--envs", "16", "--steps", "30", "--warmup", "2", "--carriers", "cuda", "cpu",
                    "--eager", "--output", str(out)], check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["envs"] == 16 and result["steps"] == 30 and result["eager"]
    if not torch.cuda.is_available():
        assert result["skipped_carriers"] == ["cuda"] and list(result["carriers"]) == ["cpu"]
    cpu = result["carriers"]["cpu"]
    assert cpu["device"] == "cpu"
    phases = {k: v["median"] for k, v in cpu["phases_ms"].items()}
    # MuJoCo's step and the managers' state update are inside UniLab's own step total, and the
    # probe's wall clock around env.step holds that total
    assert 0 < phases["backend_physics_ms"] < phases["env_step_total_ms"]
    assert 0 < phases["update_state_ms"] < phases["env_step_total_ms"]
    assert cpu["wall_ms"]["median"] >= 0.9 * phases["env_step_total_ms"]
    assert cpu["warmup_s"] > 0 and cpu["construct_s"] > 0 and cpu["first_reset_s"] > 0

"""The scripts in examples/ run as their docstrings say, at tiny sizes (their flags), so that the
README's and the docs' pointers to them stay true."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import autopar

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(name: str, *argv: str) -> None:
    """Run ``examples/<name>`` in this process as ``python examples/<name> argv...`` runs it."""
    saved = sys.argv
    sys.argv = [str(EXAMPLES / name), *argv]
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    finally:
        sys.argv = saved


@pytest.mark.slow   # two processes, each importing torch and compiling: about 20 s on two loaded cores
def test_train_torchrun(tmp_path):
    """Two gloo processes under torchrun: compile, a plain loop of 2 steps, a checkpoint. The
    environment (tests/conftest.py) keeps the compile from measuring this host."""
    checkpoint = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLES / "train_torchrun.py"), "--mesh", "2", "--model", "gpt-tiny", "--batch", "8", "--seq", "16",
         "--steps", "2", "--checkpoint", str(checkpoint)],
        env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 1: loss" in done.stdout
    assert "checkpoint saved to" in done.stdout
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_plan_cluster(tmp_path, capsys):
    """A plan for an 8-GPU mesh of H100s, made here on meta, saved and reloaded."""
    path = tmp_path / "plan.json"
    run_example("plan_cluster.py", "--model", "gpt-tiny", "--mesh", "2x4", "--time-limit", "30",
                "--json", str(path))
    out = capsys.readouterr().out
    assert "predicted step" in out and "h100-80gb" in out
    plan = autopar.Plan.from_json(str(path))
    assert tuple(plan.mesh.shape) == (2, 4) and plan.precision == "bf16"


def test_compare_strategies(capsys):
    """Every hand plan of a 1-D mesh and the auto plan, in one table."""
    run_example("compare_strategies.py", "--model", "gpt-tiny", "--mesh", "2", "--time-limit", "30")
    lines = capsys.readouterr().out.splitlines()
    names = {line.split()[0] for line in lines[2:]}
    assert {"ddp", "fsdp", "autopar.plan"} <= names
    assert lines[-1].startswith("autopar.plan (")

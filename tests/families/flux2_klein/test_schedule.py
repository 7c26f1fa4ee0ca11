"""The `flux2` rule (gmlx_contract.schedules, docs/contract.md §5.3) against its references:
bit for bit against ComfyUI's Flux2Scheduler (`get_schedule`, when COMFYUI_DIR names a
ComfyUI checkout that has it; COMFYUI_PYTHON its interpreter, default this one), and within one
float32 rounding of Flux2KleinPipeline's schedule (its numpy linspace from 1 to 1/steps and its
numpy division differ from torch's by at most an ulp)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gmlx_contract.schedules import rule_sigmas

from tests.families.flux2_klein.tiny.folder import SCHEDULER_CONFIG

CASES = [
    (steps, tokens)
    for steps in (1, 2, 4, 8, 20, 50)
    for tokens in (16, 256, 1024, 4300, 4301, 8192)
]
RULE = {"rule": "flux2"}
COMFY_DIR = os.environ.get("COMFYUI_DIR")
ULP = 2.0**-23  # a float32 ulp at 1


def pipeline_sigmas(steps: int, tokens: int) -> np.ndarray:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import (
        compute_empirical_mu,
        retrieve_timesteps,
    )

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(SCHEDULER_CONFIG)
    sigmas = np.linspace(1.0, 1 / steps, steps)  # what the pipeline hands its scheduler
    mu = compute_empirical_mu(image_seq_len=tokens, num_steps=steps)
    retrieve_timesteps(scheduler, steps, "cpu", sigmas=sigmas, mu=mu)
    return scheduler.sigmas.numpy()


@pytest.mark.parametrize(("steps", "tokens"), CASES)
def test_within_an_ulp_of_the_pipeline(steps, tokens):
    ours = rule_sigmas(RULE, steps, tokens)
    theirs = pipeline_sigmas(steps, tokens)
    assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape
    assert np.max(np.abs(ours - theirs)) <= ULP
    assert ours[-1] == theirs[-1] == 0.0


def comfy_has_flux2_scheduler() -> bool:
    nodes = Path(COMFY_DIR or "") / "comfy_extras" / "nodes_flux.py"
    return nodes.is_file() and "def get_schedule" in nodes.read_text()


COMFY_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from comfy.cli_args import args
args.cpu = True  # before comfy.model_management reads it
from comfy_extras.nodes_flux import get_schedule
cases = json.loads(sys.argv[2])
print(json.dumps([[float(s) for s in get_schedule(steps, tokens)] for steps, tokens in cases]))
"""


@pytest.mark.skipif(not comfy_has_flux2_scheduler(), reason="COMFYUI_DIR has no Flux2Scheduler")
def test_bit_for_bit_comfyui_flux2_scheduler():
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    done = subprocess.run(
        [python, "-c", COMFY_SCRIPT, COMFY_DIR, json.dumps(CASES)],
        cwd=COMFY_DIR,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    for (steps, tokens), expected in zip(CASES, theirs, strict=True):
        ours = rule_sigmas(RULE, steps, tokens)
        assert ours.tobytes() == np.asarray(expected, np.float32).tobytes(), (steps, tokens)

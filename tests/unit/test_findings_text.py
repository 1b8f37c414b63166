"""The advice of every finding a CPU-only job can get (gloo, no GPU) holds on a CPU: a step that
only a GPU has (nsys's CUDA trace, NCCL_DEBUG, dcgmi, XIDs, pinned host memory, offloading to the
host) is said as "on a GPU". A hunt read `data_loading` telling a CPU job to set pin_memory=True,
`mfu_drop` to run nsys --trace=cuda, and `hang` to set NCCL_DEBUG on gloo."""

import re

import pytest

from stepwatch.analysis.kinds import KINDS

# Kinds whose detectors run on a CPU-only job (the others need NVML, CUDA events, NCCL or a GPU
# trace: their advice may speak of GPUs alone).
CPU_KINDS = ["data_loading", "mfu_drop", "low_mfu", "straggler", "hang", "memory_near_limit", "memory_growth",
             "grad_norm_spike", "nonfinite_grads", "step_time_spike", "allreduce_not_overlapped", "slow_checkpoint"]
# (``oom`` on a CPU job gets an action of its own, memory/oom.py's CPU_ACTION.)
GPU_ONLY = ["pin_memory", "nsys", "NCCL_DEBUG", "dcgmi", "XID", "offload", "SM_ACTIVE", "Tensor Core", "nccl-tests"]


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_a_cpu_jobs_advice_says_gpu_only_steps_are_for_a_gpu(kind):
    k = KINDS[kind]
    for text in (k.diagnosis, k.action):
        for sentence in re.split(r"(?<=[.;])\s+", text):
            for term in GPU_ONLY:
                at = sentence.find(term)
                if at >= 0:
                    before = sentence[:at]
                    assert "on a GPU" in before or "on GPUs" in before, (kind, term, sentence)

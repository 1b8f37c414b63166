"""Every finding kind stepwatch can emit, in one place.

Each kind carries the diagnosis and the action from the reference sheet
(``profiling-quick-reference.txt``, section named in ``source``), so a user reads what to do,
not a raw number. The README's findings table mirrors this module (a test keeps them in step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..record import Finding, SEVERITIES


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    severity: str
    diagnosis: str
    action: str
    source: str


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "data_loading",
            "warning",
            "Data loading is a bottleneck: the training loop waits on the DataLoader "
            "(mean wait over the window above 10 ms).",
            "Increase num_workers, set pin_memory=True, prefetch (prefetch_factor), "
            "or move decoding off the critical path.",
            "B.9 Storage and I/O: 'If avg_wait_ms > 10ms -> data loading is bottlenecking GPU'",
        ),
        # -- MFU, FLOPs and grad norm (analysis/flops.py, analysis/peaks.py, hooks/grads.py) --
        Kind(
            "grad_norm_spike",
            "warning",
            "The gradient norm spiked: above the absolute threshold (10) or several times its "
            "rolling median; a sign of training instability (bad batch, LR too high, loss spike).",
            "Inspect the batch of that step and the learning-rate schedule; lower the LR or "
            "warm up longer, clip gradients (clip_grad_norm_), check for bad data.",
            "B.7 PromQL: 'train_grad_norm > 10  # potential training instability'",
        ),
        Kind(
            "nonfinite_grads",
            "critical",
            "Gradients contain inf or NaN (GradScaler skips such steps; without it the parameters "
            "are corrupted).",
            "Under fp16 a few skipped steps while the loss scale settles are normal; if it "
            "persists, look for overflow (lower LR, bf16 instead of fp16, check the loss and "
            "data for inf/NaN).",
            "stepwatch: global grad norm not finite (torch.amp.GradScaler found_inf semantics)",
        ),
        Kind(
            "mfu_drop",
            "warning",
            "MFU dropped by more than 5 percentage points compared with 10 minutes earlier.",
            "Look at what changed: data wait, exposed communication, a straggler rank, thermal "
            "throttling; capture a profile of a slow step (nsys --trace=cuda,nvtx,nccl).",
            "B.7 'MFU drop detection (alert if drops > 5 pp in 10 min)'; the sheet's PromQL "
            "`training_mfu - training_mfu offset 10m > 0.05` fires on a rise, so stepwatch "
            "uses `training_mfu offset 10m - training_mfu > 0.05`",
        ),
        Kind(
            "tensor_core_alignment",
            "info",
            "Matmuls that cannot use Tensor Cores fully: dimensions not multiples of 8 (bf16/fp16) "
            "or 16 (fp8/int8), or fp32 matmuls without TF32; the summary names the layers.",
            "Pad the named layers' sizes (hidden, vocab, heads*head_dim) to multiples of 8/16, or "
            "enable TF32 (torch.backends.cuda.matmul.allow_tf32 = True) / train in bf16.",
            "B.3 'must be multiples of 8 for BF16 Tensor Cores, multiples of 16 for INT8'",
        ),
        # -- communication and stragglers (comm/) --
        Kind(
            "allreduce_not_overlapped",
            "warning",
            "AllReduce is not overlapped with backward: most gradient communication runs after the "
            "backward compute instead of behind it (overlap below the 80% target); expect a 10-30% "
            "throughput loss.",
            "Enable gradient_as_bucket_view=True in DDP, and use buckets small enough to start during "
            "backward (bucket_cap_mb, default 25); check that no hook or sync point delays the first bucket.",
            "B.2 'NCCL spans overlap backward kernels -> measure overlap fraction, target > 80%'; "
            "'NCCL spans are sequential after backward -> Allreduce not overlapped, 10-30% throughput "
            "loss -> Enable gradient_as_bucket_view=True in DDP'",
        ),
        Kind(
            "low_busbw",
            "warning",
            "AllReduce bus bandwidth is below the healthy baseline for this hardware: the NVLink or "
            "InfiniBand fabric (or NCCL's configuration) is degraded.",
            "Run `stepwatch bench-comm` (or nccl-tests all_reduce_perf -b 1M -e 1G -f 2) and compare busbw; "
            "single node: check NVLink (DCGM fields 1011/1012); multi-node: check `ibstatus` and NCCL_IB_HCA.",
            "B.5 baselines: H100 x8 NVLink busbw >= 160 GB/s at 256MB, >= 180 at 1GB, alert < 140; "
            "H100 x64 IB NDR >= 40 at 256MB, >= 45 at 1GB, alert < 35; B.10 'busbw vs. healthy baseline'",
        ),
        Kind(
            "straggler",
            "warning",
            "Straggler rank: its compute time (step time minus data wait and exposed communication) "
            "exceeds the median of the other ranks' for several windows in a row; every collective "
            "waits for it, so the other ranks' step time grows by the same amount.",
            "Inspect the named ranks and hosts: GPU throttling, XIDs, ECC (`dcgmi dmon -e 1003` across "
            "nodes), CPU contention or a noisy neighbour, uneven data (sequence lengths) or extra work "
            "on that rank (logging, eval, checkpoint on rank 0).",
            "B.4 matrix 'Variable / Any / Any -> Straggler'; B.10 'Straggler node suspected -> outlier "
            "SM_ACTIVE vs. rest of fleet'; B.7 step time P99",
        ),
        Kind(
            "internal_error",
            "warning",
            "A part of stepwatch failed and disabled itself; training is unaffected.",
            "Report it with the logged traceback; the rest of stepwatch keeps working.",
            "stepwatch rule: never break the job",
        ),
        # -- GPU health (telemetry/): NVML/GPM readings under the DCGM names --
        Kind(
            "thermal_throttle",
            "critical",
            "The GPU is thermally throttling: temperature above 83 C with a thermal clocks-event "
            "reason set and the SM clock dropped below its healthy level.",
            "Reduce workload or improve cooling (airflow, fan, inlet temperature); check the "
            "node's other GPUs and the rack.",
            "B.4 field table: 'GPU_TEMP > 83 C -> throttle risk'; B.10 'Thermal throttling: "
            "Temp > 83 C + clocks-event reasons'; reason bits from NVML nvmlClocksEventReasons",
        ),
        Kind(
            "xid",
            "warning",
            "The driver reported an XID error (NVML event API); the summary names it, with its "
            "severity and action from the Xid table.",
            "Follow the action in the summary; check `dmesg -T | grep -i xid` on the node.",
            "B.4 'XID Error Reference'; meanings: NVIDIA Xid catalog (docs.nvidia.com/deploy/xid-errors)",
        ),
        Kind(
            "ecc_uncorrectable",
            "critical",
            "Uncorrectable (double-bit) ECC errors on the GPU: data in device memory may be corrupt.",
            "Evacuate the workload and drain the node; the GPU needs service (reset, page "
            "retirement or replacement).",
            "B.4/B.7: 'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL > 0' (critical)",
        ),
        Kind(
            "nvlink_degraded",
            "warning",
            "NVLink CRC (flit) errors are increasing: a link is degrading, which slows or breaks "
            "collectives over it.",
            "Check NVLink cables/connectors and the peer GPU (`nvidia-smi nvlink -e`); run "
            "nccl-tests all_reduce_perf and compare busbw with the healthy baseline.",
            "B.4 field table: 'NVLINK_CRC_FLIT_ERROR_COUNT > 0 -> cable/connector issue'; B.5 busbw baselines",
        ),
        Kind(
            "sm_activity",
            "warning",
            "The SM Activity Diagnostic Matrix (SM, tensor and DRAM activity over the window, "
            "joined with the step records) puts this GPU in an unhealthy row; the finding's "
            "diagnosis and action name the row.",
            "Follow the row's action; open an nsys timeline for launch gaps.",
            "B.4 'SM Activity Diagnostic Matrix'; thresholds from its field table (SM_ACTIVE > 85% "
            "high, < 50% low; TENSOR > 60% high, < 20% low; FP64 > 5% fallback bug)",
        ),
        Kind(
            "gpu_straggler",
            "warning",
            "Straggler GPU: one rank's SM activity varies while the other ranks hold steady, so "
            "every collective waits for it.",
            "Inspect that rank's GPU (throttling, XIDs, ECC, PCIe/NVLink) and its host (CPU "
            "contention, data loading); compare `dcgmi dmon -e 1002` across ranks.",
            "B.4 matrix row 'Variable / Any / Any -> Straggler'; B.10 'Outlier SM_ACTIVE vs. rest of fleet'",
        ),
        Kind(
            "slow_checkpoint",
            "warning",
            "Checkpointing takes more than 8% of run time (2-8% is normal), or saves write slower "
            "than 2 GB/s.",
            "Measure the storage (`stepwatch doctor --storage DIR`), save asynchronously "
            "(torch.distributed.checkpoint async_save), shard the checkpoint, or save less often.",
            "B.9: 'a healthy training job loses 2-8% to checkpoint overhead'; '> 10 GB/s healthy; "
            "< 2 GB/s -> storage degraded'",
        ),
        # -- serving (serving/: `stepwatch serve-vllm`), thresholds from B.6 -------------------
        Kind(
            "kv_cache_cascade",
            "critical",
            "KV-cache usage has stayed above 0.82: past ~0.85 vLLM preempts (evicts) in-flight "
            "requests to reclaim blocks, and they re-prefill from scratch (TTFT spikes 5-20x). "
            "Critical when preemptions are already rising, warning before.",
            "Reduce max_num_seqs, enable chunked prefill, or reduce max_model_len; add replicas.",
            "B.6 'vllm:gpu_cache_usage_perc > 0.82 -> CASCADE RISK' (now vllm:kv_cache_usage_perc), "
            "'KV Cache Cascade' note",
        ),
        Kind(
            "ttft_slo",
            "warning",
            "Time-to-first-token P99 over the window is above the configured SLO (prefill latency: "
            "queueing, long prompts, preemption re-prefills).",
            "Check queue depth and KV-cache usage first; then prefill cost (prompt lengths, chunked "
            "prefill, max_num_batched_tokens) and capacity (replicas).",
            "B.6 'vllm:time_to_first_token_seconds ... P99 > SLO threshold'; B.7 histogram_quantile(0.99, ...)",
        ),
        Kind(
            "queue_depth",
            "warning",
            "More than 50 requests are waiting to be scheduled: the server is throughput-limited.",
            "Add capacity (replicas, larger max_num_seqs if the KV cache has room) or shed load "
            "upstream; check that running requests are near max_num_seqs.",
            "B.6 'vllm:num_requests_waiting > 50 -> throughput limited'",
        ),
        Kind(
            "spec_decode_acceptance",
            "warning",
            "Speculative decoding accepts fewer than 65% of draft tokens (accepted / draft tokens "
            "over the window): the draft model costs more than it saves.",
            "Use a draft model closer to this workload, fewer speculative tokens, or turn "
            "speculative decoding off.",
            "B.6 'spec_decode_draft_acceptance_rate < 0.65 -> wrong draft model for this workload' "
            "(gauge gone; delta of num_accepted_tokens_total / num_draft_tokens_total)",
        ),
        Kind(
            "serving_errors",
            "warning",
            "A share of requests over the window ended in error (finished_reason=error) or got "
            "HTTP 5xx responses.",
            "Read the server log around the finding's time; check for engine restarts, OOM and "
            "malformed requests.",
            "B.7 'INFERENCE ERROR RATE' query (request_count_total is gone: finished_reason labels); "
            "5% is stepwatch's default",
        ),
        Kind(
            "stall",
            "critical",
            "The engine has stopped: requests are in flight but no token was produced for the "
            "stall timeout (vLLM's /health stays 200 while the engine is frozen). The finding "
            "names the stuck process and where it is; stacks of every process are in the run dir.",
            "Read stall-<n>/report.json and the stacks.<pid>.txt files; a stopped (T) or D-state "
            "process points at a signal or the device/driver; restart the server if it does not recover.",
            "stepwatch rule; B.6 troubleshooting 'Training hang ... py-spy dump --pid'",
        ),
        # -- memory (memory/) --
        Kind(
            "memory_growth",
            "warning",
            "Memory rises steadily step after step (a leak): tensors kept in a list, a growing "
            "cache, a loss or output kept with its graph (summed without .item()/.detach()). The "
            "summary gives the rate in MiB per step and the step at which the limit is reached.",
            "Find what is kept across steps: accumulate metrics with loss.item() or loss.detach(), "
            "clear or bound caches, del per-step outputs; read oom-<n>/memory_snapshot.pickle (CUDA "
            "allocation history, switched on by this finding) in https://pytorch.org/memory_viz; "
            "for DataLoader workers, keep dataset state in numpy arrays, not Python lists of objects.",
            "stepwatch rule: least-squares rate over the growth window, quarter medians rising, R^2 >= 0.8",
        ),
        Kind(
            "memory_fragmentation",
            "warning",
            "The CUDA caching allocator is fragmented: allocations had to free the cache and retry "
            "(num_alloc_retries, each a synchronizing stall), or memory reserved far exceeds the peak "
            "in use (reserved >> allocated).",
            "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; avoid tensors whose sizes vary "
            "step to step (pad or bucket sequence lengths); do not call torch.cuda.empty_cache() in the loop.",
            "torch.cuda.memory_stats num_alloc_retries; PyTorch CUDA semantics, 'Optimizing memory "
            "usage with PYTORCH_CUDA_ALLOC_CONF' (expandable_segments)",
        ),
        Kind(
            "memory_near_limit",
            "warning",
            "Memory is close to the limit: device free memory below 5000 MiB, or host memory in use "
            "above 90% of the cgroup limit (or physical RAM). The next larger batch or sequence will OOM.",
            "Shrink what the step holds: a smaller micro-batch (with gradient accumulation), "
            "activation checkpointing, optimizer state offload or sharding (FSDP/ZeRO); on the host, "
            "fewer DataLoader workers, persistent_workers=True, a smaller prefetch_factor.",
            "B.7 'FREE GPU MEMORY (low = risk of OOM): DCGM_FI_DEV_FB_FREE < 5000' (MiB); host: 90% of "
            "the limit, stepwatch's default",
        ),
        Kind(
            "oom",
            "critical",
            "The job ran out of memory (torch.OutOfMemoryError or MemoryError) in the phase and step "
            "named; oom-<n>/ holds the last records, the allocator's statistics and summary, and a "
            "snapshot for PyTorch's memory visualizer.",
            "Read oom-<n>/report.json (requested size, allocated/reserved/free) and memory_summary.txt; "
            "open memory_snapshot.pickle in https://pytorch.org/memory_viz. Then reduce the micro-batch, "
            "checkpoint activations, offload or shard optimizer state, or set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True when reserved >> allocated.",
            "stepwatch rule; torch.cuda.memory_summary / _record_memory_history / _snapshot",
        ),
        # -- hang watchdog and captures (capture/) --
        Kind(
            "hang",
            "critical",
            "The job stopped making progress (no step end, phase change or completed collective "
            "for the hang timeout). The summary names the laggard rank(s) that did not enter the "
            "collective the others wait in -- or, when every rank sits in the same collective, the "
            "device or the network.",
            "Read hang-<n>/report.json and the laggard's stacks.rank<R>.txt: its top frames show "
            "where it is stuck (data loading, a rank-dependent branch, I/O, a GIL-holding C call). "
            "When no rank is behind, check the GPUs (XIDs, ECC) and the network (NCCL_DEBUG=INFO).",
            "stepwatch rule; B.6 troubleshooting 'Training hang ... py-spy dump --pid'",
        ),
        Kind(
            "step_time_spike",
            "warning",
            "A step took much longer than its neighbours: above the rolling median plus several "
            "MAD-sigmas (evaluation and checkpoint time excluded).",
            "Read the capture stepwatch took of the next steps (captures/*.trace.json.gz, open in "
            "Perfetto) and the step's phase split: data wait, forward, backward, optimizer.",
            "stepwatch rule: robust outlier test, median + k x 1.4826 x MAD (Rousseeuw & Croux 1993)",
        ),
    )
}


def make_finding(
    kind: str,
    *,
    rank: int,
    step: int | None,
    summary: str,
    data: dict[str, Any] | None = None,
    severity: str | None = None,
    when: float | None = None,
) -> Finding:
    """Build a finding of a registered kind; the diagnosis and action come from the table."""
    k = KINDS[kind]
    sev = severity or k.severity
    if sev not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, got {sev!r}")
    return Finding(
        time=time.time() if when is None else when,
        step=step,
        rank=rank,
        kind=kind,
        severity=sev,
        summary=summary,
        diagnosis=k.diagnosis,
        action=k.action,
        data=dict(data or {}),
    )

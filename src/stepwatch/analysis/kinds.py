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
            "(mean wait over the window above STEPWATCH_DATA_WAIT_MS, 10 ms by default).",
            "Increase num_workers, prefetch (prefetch_factor), or move decoding off the critical "
            "path; on a GPU, pin_memory=True for the host-to-device copy.",
            "B.9 Storage and I/O: 'If avg_wait_ms > 10ms -> data loading is bottlenecking GPU'",
        ),
        # -- MFU, FLOPs and grad norm (metrics/flops.py, metrics/peaks.py, metrics/grads.py) --
        Kind(
            "grad_norm_spike",
            "warning",
            "The gradient norm spiked: above the absolute threshold (STEPWATCH_GRAD_NORM_SPIKE_ABS, 10 by "
            "default) or STEPWATCH_GRAD_NORM_SPIKE_FACTOR (5) times its rolling median; a sign of "
            "training instability (bad batch, LR too high, loss spike).",
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
            "MFU dropped by more than STEPWATCH_MFU_DROP_POINTS (5 by default) percentage points compared "
            "with STEPWATCH_MFU_DROP_WINDOW_S (10 minutes by default) earlier.",
            "Look at what changed: data wait, exposed communication, a straggler rank, thermal "
            "throttling; capture a profile of a slow step (`stepwatch capture`, or on a GPU nsys "
            "--trace=cuda,nvtx,nccl).",
            "B.7 'MFU drop detection (alert if drops > 5 pp in 10 min)'; the sheet's PromQL "
            "`training_mfu - training_mfu offset 10m > 0.05` fires on a rise, so stepwatch "
            "uses `training_mfu offset 10m - training_mfu > 0.05`",
        ),
        Kind(
            "low_mfu",
            "warning",
            "MFU (window median) is below STEPWATCH_LOW_MFU (0.4, i.e. 40%, by default): most of the "
            "step is not model math on the device. "
            "The summary says where the step time goes (data wait, forward, backward, optimizer, "
            "other, exposed communication) and which part to look at first.",
            "Start where the summary points; for compute-side time, profile a few steps (the capture "
            "stepwatch took, `stepwatch capture`, or on a GPU nsys) and look on the timeline for idle "
            "gaps between kernels or ops, and for the few that take the time.",
            "B.10 'Low MFU in training (< 40%) -> nsys --trace=cuda,nvtx,nccl -> Timeline: idle gaps "
            "between kernels'; threshold configurable (STEPWATCH_LOW_MFU)",
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
            "backward compute instead of behind it (overlap below STEPWATCH_OVERLAP_THRESHOLD, the 0.8 "
            "target by default). The exposed time "
            "the summary states is throughput lost every step (10-30% of it in the reference "
            "sheet's typical case).",
            "Use buckets small enough to start during backward (DDP's bucket_cap_mb, default 25: a "
            "model whose gradients fit in one bucket cannot overlap at all), and enable "
            "gradient_as_bucket_view=True in DDP; check that no hook or sync point delays the first bucket.",
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
            "nccl_warning",
            "warning",
            "NCCL wrote a warning (NCCL WARN) to the user's NCCL_DEBUG_FILE: a network, topology or "
            "configuration problem that NCCL noticed; the summary quotes the line.",
            "Read the quoted line and the file around it; for network errors check the NICs "
            "(`ibstatus`, NCCL_IB_HCA, NCCL_SOCKET_IFNAME); rerun with NCCL_DEBUG=INFO for details.",
            "B.5 'NCCL_DEBUG WARN (prod) / INFO (debug)'; B.10 'AllReduce bottleneck suspected -> "
            "NCCL_DEBUG=INFO'; NCCL docs: NCCL_DEBUG_FILE",
        ),
        Kind(
            "straggler",
            "warning",
            "Straggler rank: its compute time (step time minus data wait and exposed communication) "
            "exceeds the median of the other ranks' by the margin in every window of a run of them "
            "(the summary says how many, at least a second of steps in all); every collective "
            "waits for it, so the other ranks' step time grows by the same amount.",
            "Inspect the named ranks and hosts: CPU contention or a noisy neighbour, uneven data "
            "(sequence lengths) or extra work on that rank (logging, eval, checkpoint on rank 0); on "
            "GPUs, throttling, XIDs, ECC (`dcgmi dmon -e 1003` across nodes).",
            "B.4 matrix 'Variable / Any / Any -> Straggler'; B.10 'Straggler node suspected -> outlier "
            "SM_ACTIVE vs. rest of fleet'; B.7 step time P99",
        ),
        Kind(
            "internal_error",
            "warning",
            "A part of stepwatch failed and disabled itself (a user's exporter whose export raised is tried again "
            "with the next batch); training is unaffected.",
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
            "gpu_overhead_bound",
            "warning",
            "The graphics/compute engine was active less than 60% of the time over the window "
            "(DCGM_FI_PROF_GR_ENGINE_ACTIVE): the GPU waits on the host (launch overhead, syncs, "
            "data, Python).",
            "Open an nsys timeline (nsys profile --trace=cuda,nvtx,osrt) for gaps between kernels; "
            "use CUDA graphs or torch.compile, larger batches, fewer host syncs (.item(), .cpu()).",
            "B.4 field table: 'GR_ENGINE_ACTIVE ... < 60% -> overhead-bound' (ratio 0.60 as DCGM exports it)",
        ),
        Kind(
            "low_sm_occupancy",
            "warning",
            "SMs are busy but hold few warps: SM occupancy below 25% over the window "
            "(DCGM_FI_PROF_SM_OCCUPANCY) while SM activity is not low and the tensor cores are not "
            "the busy pipe (tensor-core GEMMs run few warps per SM by design); kernels are limited by "
            "registers, shared memory or too small grids.",
            "Profile the top kernels with ncu (--section Occupancy, LaunchStats): check registers "
            "per thread, shared memory per block and grid size; larger batches or fused kernels help.",
            "B.4 field table: 'SM_OCCUPANCY ... < 25% -> occupancy limiter'",
        ),
        Kind(
            "dram_bandwidth_bound",
            "warning",
            "Device memory bandwidth is saturated: DRAM activity stayed near 100% (window mean "
            ">= 95%, DCGM_FI_PROF_DRAM_ACTIVE); the workload is memory-bandwidth bound.",
            "Cut memory traffic: fuse elementwise ops (torch.compile), use bf16/fp8 activations, "
            "flash attention, larger arithmetic intensity per kernel (check with ncu's roofline).",
            "B.4 field table: 'DRAM_ACTIVE ... Constant 100% -> BW bottleneck'; 95% is stepwatch's 'near'",
        ),
        Kind(
            "hbm_thermal",
            "critical",
            "Memory (HBM) temperature above 90 C (DCGM_FI_DEV_MEMORY_TEMP): at its thermal limit "
            "the GPU slows memory down or throttles.",
            "Improve cooling (airflow, fans, inlet temperature), check the node's other GPUs and the "
            "rack; reduce memory-bound load until it cools.",
            "B.4 field table: 'MEM_MAX_OP_TEMP > 90 C -> HBM thermal limit' (judged on the memory "
            "temperature, field 140)",
        ),
        Kind(
            "power_limited",
            "warning",
            "The GPU ran at its enforced power limit for the window (power >= 97% of the limit or "
            "NVML's SwPowerCap reason on most samples): clocks are held down by the power cap.",
            "Check the limit (`nvidia-smi -q -d POWER`: enforced vs default limit); raise it to the "
            "default if an admin lowered it, or accept the power-capped clocks.",
            "B.4 field table: 'POWER_USAGE ... Near TDP limit consistently'; bitmask 'SW_POWER_CAP: "
            "power cap set below workload demand (check nvidia-smi -q -d POWER)'",
        ),
        Kind(
            "nvlink_low_bandwidth",
            "warning",
            "NVLink TX or RX bytes per second of collective time are below the healthy baseline "
            "for this hardware (350 GB/s on H100 SXM x8) while the job is communication-bound.",
            "Check the links (`nvidia-smi nvlink -s`, `-e` for errors), run `stepwatch bench-comm` "
            "(or nccl-tests all_reduce_perf) and compare busbw with the baseline.",
            "B.4 field table: 'NVLINK_TX_BYTES / RX_BYTES near 450 GB/s (H100x8), < 350 GB/s -> "
            "degradation'; B.10 'NVLink underperformance -> dcgmi dmon -e 1011,1012'",
        ),
        Kind(
            "ecc_sbe_rate",
            "warning",
            "Correctable (single-bit) ECC errors arrive faster than 1,000 per hour: the memory is "
            "degrading and uncorrectable errors may follow.",
            "Watch the trend (`nvidia-smi --query-gpu=ecc.errors.corrected.volatile.total --format=csv`); "
            "schedule maintenance for the GPU (page retirement / row remapping, replacement).",
            "B.4 XID table: '80 Correctable SBE (Single-Bit ECC) LOW: Monitor rate; alert if > 1,000/hr'; "
            "B.10 'ECC error escalation -> corrected ECC count trend / hour'",
        ),
        Kind(
            "slow_checkpoint",
            "warning",
            "Checkpointing takes more than 8% of run time (2-8% is normal; judged once a minute of "
            "run time is behind it), or saves write slower than 2 GB/s.",
            "Measure the storage (`stepwatch doctor --storage DIR`), save asynchronously "
            "(torch.distributed.checkpoint async_save), shard the checkpoint, or save less often.",
            "B.9: 'a healthy training job loses 2-8% to checkpoint overhead'; '> 10 GB/s healthy; "
            "< 2 GB/s -> storage degraded'",
        ),
        # -- serving (serving/: `stepwatch serve-vllm`), thresholds from B.6 -------------------
        Kind(
            "kv_cache_cascade",
            "critical",
            "KV-cache usage has stayed above serve-vllm's --kv-threshold (0.82 by default): past "
            "~0.85 vLLM preempts (evicts) in-flight "
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
            "More requests than serve-vllm's --queue-threshold (50 by default) are waiting to be "
            "scheduled: the server is throughput-limited.",
            "Add capacity (replicas, larger max_num_seqs if the KV cache has room) or shed load "
            "upstream; check that running requests are near max_num_seqs.",
            "B.6 'vllm:num_requests_waiting > 50 -> throughput limited'",
        ),
        Kind(
            "spec_decode_acceptance",
            "warning",
            "Speculative decoding accepts fewer draft tokens than serve-vllm's --spec-threshold "
            "(0.65 by default; accepted / draft tokens over the window): the draft model costs more "
            "than it saves.",
            "Use a draft model closer to this workload, fewer speculative tokens, or turn "
            "speculative decoding off.",
            "B.6 'spec_decode_draft_acceptance_rate < 0.65 -> wrong draft model for this workload' "
            "(gauge gone; delta of num_accepted_tokens_total / num_draft_tokens_total)",
        ),
        Kind(
            "serving_errors",
            "warning",
            "A share of requests over the window above serve-vllm's --error-threshold (0.05 by "
            "default) ended in error (finished_reason=error) or got HTTP 5xx responses.",
            "Read the server log around the finding's time; check for engine restarts, OOM and "
            "malformed requests.",
            "B.7 'INFERENCE ERROR RATE' query (request_count_total is gone: finished_reason labels); "
            "5% is stepwatch's default",
        ),
        Kind(
            "inter_token_latency",
            "warning",
            "Inter-token latency (time per output token) P99 over the window is above serve-vllm's "
            "--itl-threshold (0.1 s by default): decode "
            "steps are slow (large batches, long contexts, preemption, a slow device).",
            "Check running requests against max_num_seqs and KV-cache usage; lower max_num_seqs or "
            "max_num_batched_tokens, enable chunked prefill so prefills do not stall decodes, add replicas.",
            "B.6 'vllm:time_per_output_token_seconds ... P99 > 100ms typical' (now "
            "vllm:inter_token_latency_seconds; both names read)",
        ),
        Kind(
            "e2e_slo",
            "warning",
            "End-to-end request latency P99 over the window is above the configured SLO "
            "(queueing + prefill + decode).",
            "Look at which part grew: TTFT (queue, prefill) or inter-token latency (decode); then "
            "queue depth, KV-cache usage and capacity (replicas).",
            "B.6 'vllm:e2e_request_latency_seconds ... P99 per SLO'",
        ),
        Kind(
            "max_num_seqs_saturated",
            "warning",
            "Running requests are at max_num_seqs while requests wait: the scheduler's batch is full, "
            "so new requests queue (TTFT grows) even if the device could take more.",
            "If KV-cache usage has room, raise max_num_seqs; otherwise add replicas or shed load upstream.",
            "B.6 'vllm:num_requests_running ... Near max_num_seqs'; 'num_requests_waiting > 50 -> "
            "throughput limited'",
        ),
        Kind(
            "prefill_rate_drop",
            "warning",
            "Prompt (prefill) tokens per second fell below half of their median over the window "
            "while requests wait: prefill has slowed down (preemption re-prefills, long prompts "
            "crowding the batch, a slowed device).",
            "Check preemptions and KV-cache usage first, then prompt lengths and "
            "max_num_batched_tokens / chunked prefill; compare with the device's telemetry.",
            "B.6 'vllm:prompt_tokens_total ... Rate tracks prefill load'; 50% of the window median "
            "is stepwatch's rule",
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
            "clear or bound caches, del per-step outputs. Each finding's action is for the memory that "
            "grew: CUDA, read oom-<n>/memory_snapshot.pickle (CUDA allocation history, switched on by "
            "this finding) in https://pytorch.org/memory_viz; the trainer's RSS, memray run --native "
            "(torch's CPU tensors; tracemalloc sees only Python objects); DataLoader workers, keep "
            "dataset state in numpy arrays, not Python lists of objects.",
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
            "activation checkpointing, sharding (FSDP/ZeRO), on a GPU optimizer state offload; on the "
            "host, fewer DataLoader workers, persistent_workers=True, a smaller prefetch_factor.",
            "B.7 'FREE GPU MEMORY (low = risk of OOM): DCGM_FI_DEV_FB_FREE < 5000' (MiB); host: 90% of "
            "the limit, stepwatch's default",
        ),
        Kind(
            "oom",
            "critical",
            "The job ran out of memory (torch.OutOfMemoryError, MemoryError, or torch's CPU allocator's "
            "RuntimeError) in the phase and step named; oom-<n>/ holds the last records and, where CUDA "
            "is in use, the allocator's statistics and summary and a snapshot for PyTorch's memory visualizer.",
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
            "When no rank is behind, check the network and, on GPUs, the devices (XIDs, ECC) and "
            "NCCL (NCCL_DEBUG=INFO).",
            "stepwatch rule; B.6 troubleshooting 'Training hang ... py-spy dump --pid'",
        ),
        # -- trace analysis (traces/, docs/traces.md): what a capture's timeline shows --
        Kind(
            "trace_dense",
            "info",
            "The GPU row of the captured steps is dense (idle below 10% of the span, no gap over "
            "1 ms): compute-bound or bandwidth-bound, healthy.",
            "No action needed; verify the kernels' efficiency with ncu's roofline.",
            "B.2 'GPU row is dense -- no visible gaps -> Compute-bound or bandwidth-bound -- healthy'",
        ),
        Kind(
            "trace_idle_gaps",
            "warning",
            "The GPU idles between kernels for more than 1 ms at a time: CPU launch overhead (the "
            "host cannot enqueue kernels fast enough) or a pipeline stall; the summary names the "
            "CPU op spanning the largest gap.",
            "Use CUDA Graphs or torch.compile (mode='reduce-overhead') to remove the launch gaps; "
            "if the named op is Python work between launches, move it off the step.",
            "B.2 'Gaps > 1 ms between kernels -> CPU launch overhead or data pipeline stall -> Use CUDA "
            "Graphs or torch.compile'; B.10 'Low MFU -> timeline: idle gaps between kernels'",
        ),
        Kind(
            "trace_data_stall",
            "warning",
            "The captured steps wait on data loading: the largest idle gap (GPU idle, or in a CPU "
            "capture the training thread running no op) is spent inside the DataLoader.",
            "Prefetch with pin_memory=True, increase num_workers (and prefetch_factor), or move "
            "decoding off the critical path.",
            "B.2 'CPU idle gaps between GPU launches -> Data loading bottleneck or Python GIL -> Prefetch "
            "with pin_memory=True, increase num_workers'; B.10 'Data loading bottleneck'",
        ),
        Kind(
            "trace_host_sync",
            "warning",
            "A host-device sync inside the step (cudaStreamSynchronize, .item(), .cpu(), nonzero, "
            "a print of a tensor) stops the CPU until the GPU drains; the GPU then idles while the "
            "CPU launches again. The summary names the op and, when the trace has stacks, the call site.",
            "Remove the sync from the step or do it every N steps (log losses asynchronously); "
            "torch.cuda.set_sync_debug_mode('warn') reports each one.",
            "B.2 'CPU idle gaps between GPU launches'; B.10 'Low MFU -> timeline: idle gaps between kernels'",
        ),
        Kind(
            "trace_tiny_kernels",
            "warning",
            "Most of the GPU's kernel time is in tiny kernels (< 50 µs each): op-by-op execution, "
            "poor fusion.",
            "Enable torch.compile or fuse kernels by hand (fused optimizers: foreach/fused=True).",
            "B.2 'Many tiny kernels (< 50 µs each) -> Op-by-op execution -- poor fusion -> Enable "
            "torch.compile or manual kernel fusion'",
        ),
        Kind(
            "trace_rank_idle",
            "warning",
            "In the same captured steps, one rank's GPU idled much more than the others' (10 "
            "points above their median): that rank is host-bound while the others compute, and "
            "every collective waits for it.",
            "Read that rank's gaps (stepwatch trace on its capture): data loading, host syncs or "
            "extra work on that rank (logging, eval, checkpoint on rank 0).",
            "B.2 'what to look for in the timeline', across ranks; B.4 matrix 'Variable -> Straggler'",
        ),
        Kind(
            "step_time_spike",
            "warning",
            "A step took much longer than its neighbours: above the rolling median plus several "
            "MAD-sigmas, at least twice the median and 2 ms over it (evaluation and checkpoint time excluded, and the steps stepwatch's own capture "
            "profiled). When most of the excess was spent waiting in a collective for another rank (its "
            "checkpoint, evaluation or slow step), the finding is info and says so.",
            "Read the step's phase split (data wait, forward, backward, optimizer); where captures "
            "are on and one was taken of the next steps (captures/*.trace.json.gz; run.json's "
            "features.capture lists them), open it in Perfetto or run stepwatch trace on it.",
            "stepwatch rule: robust outlier test, median + k x 1.4826 x MAD (Rousseeuw & Croux 1993)",
        ),
    )
}


def make_finding(
    kind: str,
    *,
    rank: int | None,
    step: int | None,
    summary: str,
    data: dict[str, Any] | None = None,
    severity: str | None = None,
    when: float | None = None,
    action: str | None = None,
) -> Finding:
    """Build a finding of a registered kind; the diagnosis and action come from the table
    (``action``: one for this case, where the table's does not fit it)."""
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
        action=k.action if action is None else action,
        data=dict(data or {}),
    )

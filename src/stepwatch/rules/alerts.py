"""Prometheus alerting rules for training, GPU health and serving, with a ``promtool test rules``
case for every alert: input series that fire and series that do not.

Thresholds come from the reference sheet (``profiling-quick-reference.txt`` B.4, B.6, B.7), with
its mistakes corrected:

* DCGM profiling fields are ratios 0-1 in the DCGM exporter (dcgm-exporter
  ``dcp-metrics-included.csv``), so ``DCGM_FI_PROF_SM_ACTIVE < 50`` is always true: ``< 0.5``.
* The MFU-drop query ``training_mfu - training_mfu offset 10m > 0.05`` fires on a *rise*: the drop
  is ``training_mfu offset 10m - training_mfu > 0.05``.
* The throttle field is ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` now (was ``..._CLOCK_THROTTLE_REASONS``)
  and its bit 0x1 is "GPU idle" (nvml.h ``nvmlClocksEventReasonGpuIdle``), so ``> 0`` fires on every
  idle GPU; PromQL has no bitwise AND, so the alerts read the decoded series stepwatch exports
  (``stepwatch_gpu_clocks_event_active{reason=...}``).
* Serving rules use vLLM's current names with an ``or`` fallback to the old ones; the sheet's
  ``vllm:request_count_total`` does not exist (error rate = errors / all finished requests).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..exporters import names as N

@dataclass(frozen=True)
class Case:
    """One promtool case: ``series`` (selector, values) at ``interval``; at ``eval_time`` exactly
    the alerts with ``firing`` labels are active; at ``quiet_time`` (if set) none is."""

    series: tuple[tuple[str, str], ...]
    eval_time: str
    firing: tuple[dict[str, str], ...]
    interval: str = "1m"
    quiet_time: str | None = None


@dataclass(frozen=True)
class Alert:
    group: str
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    case: Case
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Thresholds:
    """Knobs of the generated rules (``stepwatch rules --help``)."""

    ttft_p99_s: float = 2.0  # serving SLO; the sheet says "P99 > SLO threshold" without a number
    itl_p99_s: float = 0.1  # reference B.6: "P99 > 100ms typical"
    kv_cache: float = 0.82  # reference B.6: alert at 0.82, cascade from ~0.85
    queue_depth: float = 50  # reference B.6: "> 50 -> throughput limited"
    grad_norm: float = 10  # reference B.7
    gpu_temp_c: float = 83  # reference B.4: "> 83 C -> throttle risk"
    sm_active: float = 0.5  # reference B.4 "< 50%" as the DCGM exporter's ratio
    data_wait_s: float = 0.010  # reference B.9: avg wait > 10 ms per step


def _steps(job: str = "train") -> str:
    return f'{N.STEPS_TOTAL.name}{{job="{job}",rank="%s"}}'


def _exact(x: float) -> str:
    """``x`` as written, every digit kept (``:g`` wrote an SLO of 1.23456789 as 1.23457, a
    threshold the user never gave): the float's repr, ``2`` for ``2.0``."""
    return repr(float(x)).removesuffix(".0")


def _ms(seconds: float) -> str:
    """Seconds as exact milliseconds: a decimal shift of the repr (``0.123456789 * 1000`` is
    123.45678899999999 in floats)."""
    from decimal import Decimal

    return _exact(float(Decimal(repr(float(seconds))).scaleb(3)))


def _slo_histogram(bucket: str, labels: str, slo: float, *, slow: bool) -> tuple[tuple[str, str], ...]:
    """Bucket series whose P99 lies on either side of ``slo``, whatever it is: every observation
    in (slo, 2 slo] (``slow``: P99 1.99 slo, fires) or in (slo/2, slo] (P99 0.995 slo, quiet).
    Fixed buckets were right for the default SLOs only: ``--ttft-p99-slo 0.5`` made the quiet
    model fire, ``5`` the slow one quiet. Halving and doubling are exact in binary."""
    les = (_exact(slo / 2), _exact(slo), _exact(slo * 2), "+Inf")
    counts = ("0x20", "0x20", "0+100x20", "0+100x20") if slow else ("0x20", "0+100x20", "0+100x20", "0+100x20")
    return tuple((f'{bucket}{{{labels},le="{le}"}}', c) for le, c in zip(les, counts))


def build(t: Thresholds = Thresholds()) -> list[Alert]:
    steps, mfu, gn, ar = N.STEPS_TOTAL.name, N.MFU.name, N.GRAD_NORM.name, N.ALLREDUCE_MS.name
    step_b = f"{N.STEP_SECONDS.name}_bucket"
    fnd, drp, thr = N.FINDINGS_TOTAL.name, N.DROPPED_TOTAL.name, N.GPU_THROTTLE.name
    r0 = {"job": "train", "rank": "0"}
    g0 = {"Hostname": "node1", "gpu": "0"}
    gpu = 'Hostname="node1",gpu="%s"'
    A: list[Alert] = []

    # ---- training -------------------------------------------------------------------------
    A.append(Alert(
        "stepwatch-training", "TrainingStalled", f"rate({steps}[2m]) == 0", "5m", "critical",
        "Training made no step for 5m on rank {{ $labels.rank }} ({{ $labels.job }})",
        "training_steps_total stopped increasing: the job is hung or stuck in a collective. A gauge "
        "would keep its last value; the counter's rate is 0. Run stepwatch's watchdog dump or py-spy dump.",
        Case((
            (_steps() % "0", "0+60x10 600x20"),
            (_steps() % "1", "0+60x30"),
        ), "25m", (r0,), quiet_time="12m"),
    ))
    A.append(Alert(
        "stepwatch-training", "TrainingMFUDrop", f"{mfu} offset 10m - {mfu} > 0.05", "5m", "warning",
        "MFU on rank {{ $labels.rank }} dropped more than 5 points in 10m",
        "training_mfu fell by more than 0.05 against 10 minutes ago (reference B.7, with the sign corrected: "
        "the sheet's query fires on a rise). Check data wait, throttling and stragglers.",
        Case((
            (f'{mfu}{{job="train",rank="0"}}', "0.45x15 0.30x20"),
            (f'{mfu}{{job="train",rank="1"}}', "0.45x15 0.50x20"),
        ), "24m", (r0,), quiet_time="18m"),
    ))
    A.append(Alert(
        "stepwatch-training", "TrainingGradNormSpike", f"{gn} > {t.grad_norm:g}", "1m", "warning",
        "Gradient norm above " + f"{t.grad_norm:g}" + " on rank {{ $labels.rank }}",
        "Potential training instability (reference B.7): lower the learning rate, check for bad batches, "
        "enable gradient clipping.",
        Case((
            (f'{gn}{{job="train",rank="0"}}', "1x5 50x10"),
            (f'{gn}{{job="train",rank="1"}}', "1x15"),
        ), "10m", (r0,)),
    ))
    A.append(Alert(
        "stepwatch-training", "TrainingStepTimeTail",
        f"histogram_quantile(0.99, sum by (job, rank, le) (rate({step_b}[5m]))) "
        f"> 2 * histogram_quantile(0.5, sum by (job, rank, le) (rate({step_b}[5m])))",
        "10m", "warning",
        "Step time P99 is more than twice P50 on rank {{ $labels.rank }}",
        "Slow outlier steps (reference B.7 step-time P99): data stalls, garbage collection, checkpoints or a "
        "noisy neighbour. In DDP every rank waits for the slowest, so compare compute per step across ranks.",
        Case((
            (f'{step_b}{{job="train",rank="0",le="0.1"}}', "0+95x20"),
            (f'{step_b}{{job="train",rank="0",le="1"}}', "0+95x20"),
            (f'{step_b}{{job="train",rank="0",le="2.5"}}', "0+100x20"),
            (f'{step_b}{{job="train",rank="0",le="+Inf"}}', "0+100x20"),
            (f'{step_b}{{job="train",rank="1",le="0.1"}}', "0+100x20"),
            (f'{step_b}{{job="train",rank="1",le="1"}}', "0+100x20"),
            (f'{step_b}{{job="train",rank="1",le="2.5"}}', "0+100x20"),
            (f'{step_b}{{job="train",rank="1",le="+Inf"}}', "0+100x20"),
        ), "18m", (r0,)),
    ))
    A.append(Alert(
        "stepwatch-training", "TrainingStraggler", f'increase({fnd}{{kind="straggler"}}[10m]) > 0', "0m", "warning",
        "stepwatch named a straggler (reported by rank {{ $labels.rank }})",
        "A rank's compute exceeds the others' median for several windows; the finding's data.ranks names it. "
        "Check that GPU's health and clocks, its host's data pipeline, or drain the node.",
        Case((
            (f'{fnd}{{job="train",rank="0",kind="straggler",severity="warning"}}', "0x5 1x10"),
            (f'{fnd}{{job="train",rank="1",kind="data_loading",severity="warning"}}', "0x5 1x10"),
        ), "8m", ({**r0, "kind": "straggler", "severity": "warning"},)),
    ))
    A.append(Alert(
        "stepwatch-training", "TrainingDataLoaderBound",
        f"rate({N.DATA_WAIT.name}[5m]) / rate({steps}[5m]) > {t.data_wait_s:g}", "5m", "warning",
        "Data loading stalls rank {{ $labels.rank }} (mean wait per step above " + f"{t.data_wait_s * 1000:g} ms)",
        "Reference B.9: avg wait > 10 ms -> data loading is bottlenecking the GPU. Increase num_workers, "
        "pin_memory=True, prefetch_factor, or move decoding off the critical path.",
        Case((
            (f'{N.DATA_WAIT.name}{{job="train",rank="0"}}', "0+1.2x30"),
            (f'{N.DATA_WAIT.name}{{job="train",rank="1"}}', "0+0.12x30"),
            (_steps() % "0", "0+60x30"),
            (_steps() % "1", "0+60x30"),
        ), "20m", (r0,)),
    ))
    A.append(Alert(
        "stepwatch-training", "TrainingCommNotOverlapped", f"avg_over_time({N.OVERLAP.name}[5m]) < 0.8", "10m", "warning",
        "Less than 80% of communication hides behind backward on rank {{ $labels.rank }}",
        "AllReduce not overlapped with backward (target > 80%): set gradient_as_bucket_view=True, tune "
        "bucket_cap_mb, check that no sync or .item() sits between backward and the optimizer.",
        Case((
            (f'{N.OVERLAP.name}{{job="train",rank="0"}}', "0.5x30"),
            (f'{N.OVERLAP.name}{{job="train",rank="1"}}', "0.95x30"),
        ), "20m", (r0,)),
    ))
    A.append(Alert(
        "stepwatch-training", "TrainingAllReduceSlowdown",
        f"avg_over_time({ar}[5m]) > 2 * avg_over_time({ar}[1h] offset 5m)", "5m", "warning",
        "AllReduce on rank {{ $labels.rank }} takes twice its last-hour average",
        "Reference B.5/B.7: network or NVLink degradation, or a straggler peer. Compare busbw with the "
        "healthy baseline (stepwatch bench-comm) and check DCGM NVLink/IB counters.",
        Case((
            (f'{ar}{{job="train",rank="0"}}', "10x60 30x20"),
            (f'{ar}{{job="train",rank="1"}}', "10x80"),
        ), "75m", (r0,)),
    ))
    A.append(Alert(
        "stepwatch-training", "StepwatchExporterDrops", f"increase({drp}[10m]) > 0", "0m", "warning",
        "stepwatch on rank {{ $labels.rank }} dropped metrics ({{ $labels.exporter }})",
        "The OTLP collector is unreachable or too slow (exporter=otlp), or samples could not be mapped "
        "(exporter=unmapped). Training is unaffected; the metrics of that window are lost.",
        Case((
            (f'{drp}{{job="train",rank="0",exporter="otlp"}}', "0x3 5+5x10"),
            (f'{drp}{{job="train",rank="1",exporter="otlp"}}', "0x15"),
        ), "8m", ({**r0, "exporter": "otlp"},)),
    ))
    A.append(Alert(
        "stepwatch-training", "StepwatchCriticalFinding", f'increase({fnd}{{severity="critical"}}[10m]) > 0', "0m", "critical",
        "stepwatch raised a critical {{ $labels.kind }} finding on rank {{ $labels.rank }}",
        "See the run directory's findings file for the diagnosis and the action.",
        Case((
            (f'{fnd}{{job="train",rank="0",kind="xid",severity="critical"}}', "0x5 1x10"),
            (f'{fnd}{{job="train",rank="1",kind="data_loading",severity="warning"}}', "0x5 1x10"),
        ), "8m", ({**r0, "kind": "xid", "severity": "critical"},)),
    ))

    # ---- GPU health (DCGM names; profiling fields are 0-1 ratios) -----------------------------
    thermal = "hw_slowdown|sw_thermal_slowdown|hw_thermal_slowdown"
    A.append(Alert(
        "stepwatch-gpu", "GPUThermalThrottle", f'max by (Hostname, gpu) ({thr}{{reason=~"{thermal}"}}) == 1', "5m", "warning",
        "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} is thermally throttled",
        "Clocks are held down by a thermal or hardware-slowdown reason (decoded NVML clocks-event bits; bit "
        "0x1 is 'GPU idle' and is not a throttle). Improve cooling or reduce the workload.",
        Case((
            (f'{thr}{{{gpu % "0"},reason="hw_thermal_slowdown"}}', "1x15"),
            (f'{thr}{{{gpu % "0"},reason="gpu_idle"}}', "0x15"),
            (f'{thr}{{{gpu % "1"},reason="hw_thermal_slowdown"}}', "0x15"),
            (f'{thr}{{{gpu % "1"},reason="gpu_idle"}}', "1x15"),
        ), "10m", (g0,)),
    ))
    A.append(Alert(
        "stepwatch-gpu", "GPUPowerCapped", f'max by (Hostname, gpu) ({thr}{{reason=~"sw_power_cap|hw_power_brake_slowdown"}}) == 1',
        "15m", "info",
        "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} is power-capped",
        "Power cap below the workload's demand or an upstream power brake (check nvidia-smi -q -d POWER).",
        Case((
            (f'{thr}{{{gpu % "0"},reason="sw_power_cap"}}', "1x20"),
            (f'{thr}{{{gpu % "1"},reason="sw_power_cap"}}', "0x20"),
        ), "18m", (g0,)),
    ))
    A.append(Alert(
        "stepwatch-gpu", "GPUXIDError", "DCGM_FI_DEV_XID_ERRORS > 0", "1m", "critical",
        "XID {{ $value }} on {{ $labels.Hostname }} GPU {{ $labels.gpu }}",
        "Look the XID up in NVIDIA's Xid catalog: 48/95 evacuate, 79 reset the GPU, 63/94 schedule maintenance.",
        Case((
            (f'DCGM_FI_DEV_XID_ERRORS{{{gpu % "0"}}}', "0x3 79x10"),
            (f'DCGM_FI_DEV_XID_ERRORS{{{gpu % "1"}}}', "0x13"),
        ), "8m", (g0,)),
    ))
    A.append(Alert(
        "stepwatch-gpu", "GPUHighTemperature", f"DCGM_FI_DEV_GPU_TEMP > {t.gpu_temp_c:g}", "5m", "warning",
        "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} above " + f"{t.gpu_temp_c:g} C",
        "Reference B.4: > 83 C -> throttle risk. Check cooling and fan/airflow.",
        Case((
            (f'DCGM_FI_DEV_GPU_TEMP{{{gpu % "0"}}}', "86x15"),
            (f'DCGM_FI_DEV_GPU_TEMP{{{gpu % "1"}}}', "70x15"),
        ), "10m", (g0,)),
    ))
    A.append(Alert(
        "stepwatch-gpu", "GPUUncorrectableECC", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL > 0", "1m", "critical",
        "Uncorrectable ECC error on {{ $labels.Hostname }} GPU {{ $labels.gpu }}",
        "Double-bit ECC (XID 48): evacuate the workload; the GPU needs replacement.",
        Case((
            (f'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{gpu % "0"}}}', "0x3 1x10"),
            (f'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{gpu % "1"}}}', "0x13"),
        ), "8m", (g0,)),
    ))
    A.append(Alert(
        "stepwatch-gpu", "GPUCorrectableECCRate", "increase(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL[1h]) > 1000", "0m", "warning",
        "More than 1000 correctable ECC errors in 1h on {{ $labels.Hostname }} GPU {{ $labels.gpu }}",
        "Reference B.4 (XID 80): monitor the rate, alert above 1,000/hr; schedule maintenance.",
        Case((
            (f'DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{{gpu % "0"}}}', "0+20x70"),
            (f'DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{{gpu % "1"}}}', "0+1x70"),
        ), "65m", (g0,)),
    ))
    A.append(Alert(
        "stepwatch-gpu", "GPUSMUnderutilized", f"DCGM_FI_PROF_SM_ACTIVE < {t.sm_active:g}", "10m", "warning",
        "SM activity below " + f"{t.sm_active * 100:g}%" + " for 10m on {{ $labels.Hostname }} GPU {{ $labels.gpu }}",
        "Reference B.4 (threshold as the DCGM exporter's 0-1 ratio): launch overhead or a data stall; "
        "look at stepwatch's data wait and an nsys timeline.",
        Case((
            (f'DCGM_FI_PROF_SM_ACTIVE{{{gpu % "0"}}}', "0.3x20"),
            (f'DCGM_FI_PROF_SM_ACTIVE{{{gpu % "1"}}}', "0.9x20"),
        ), "15m", (g0,)),
    ))
    A.append(Alert(
        "stepwatch-gpu", "GPUTensorCoresUnused", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE < 0.2 and DCGM_FI_PROF_SM_ACTIVE > 0.85",
        "10m", "warning",
        "Busy SMs but idle Tensor Cores on {{ $labels.Hostname }} GPU {{ $labels.gpu }}",
        "SM Activity matrix (reference B.4): high SM, low tensor -> wrong dtype (use bf16/fp16) or "
        "matrix dimensions not multiples of 8/16.",
        Case((
            (f'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{gpu % "0"}}}', "0.05x20"),
            (f'DCGM_FI_PROF_SM_ACTIVE{{{gpu % "0"}}}', "0.95x20"),
            (f'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{gpu % "1"}}}', "0.7x20"),
            (f'DCGM_FI_PROF_SM_ACTIVE{{{gpu % "1"}}}', "0.95x20"),
        ), "15m", (g0,)),
    ))
    A.append(Alert(
        "stepwatch-gpu", "GPUFP64Active", "DCGM_FI_PROF_PIPE_FP64_ACTIVE > 0.05", "10m", "warning",
        "FP64 pipe busy on {{ $labels.Hostname }} GPU {{ $labels.gpu }}",
        "Reference B.4: FP64 > 5% in AI workloads -> an FP64 fallback bug (a float64 tensor in the model).",
        Case((
            (f'DCGM_FI_PROF_PIPE_FP64_ACTIVE{{{gpu % "0"}}}', "0.3x20"),
            (f'DCGM_FI_PROF_PIPE_FP64_ACTIVE{{{gpu % "1"}}}', "0x20"),
        ), "15m", (g0,)),
    ))
    A.append(Alert(
        "stepwatch-gpu", "GPUNVLinkCRCErrors",
        "increase(DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL[10m]) > 0 "
        "or increase(DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L0[10m]) > 0",
        "0m", "warning",
        "NVLink CRC errors on {{ $labels.Hostname }} GPU {{ $labels.gpu }}",
        "Reference B.4: > 0 -> cable/connector issue; check the link and the peer GPU.",
        Case((
            (f'DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL{{{gpu % "0"}}}', "0x5 3x10"),
            (f'DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL{{{gpu % "1"}}}', "0x15"),
        ), "8m", (g0,)),
    ))

    # ---- serving (vLLM's own names: current first, old as fallback) ---------------------------
    m_new = 'job="vllm",model_name="m",engine="0"'
    m_ok = 'job="vllm",model_name="ok",engine="0"'
    m_old = 'job="vllm-old",model_name="m",engine="0"'
    A.append(Alert(
        "stepwatch-serving", "VLLMKVCacheCascadeRisk",
        f"(vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc) > {t.kv_cache:g}", "2m", "critical",
        "KV cache above " + f"{t.kv_cache * 100:g}%" + " on {{ $labels.model_name }} ({{ $labels.job }})",
        "Reference B.6: above ~0.85 vLLM preempts requests and TTFT spikes 5-20x. Reduce max_num_seqs, "
        "enable chunked prefill or reduce max_model_len.",
        Case((
            (f"vllm:kv_cache_usage_perc{{{m_new}}}", "0.9x10"),
            (f"vllm:kv_cache_usage_perc{{{m_ok}}}", "0.5x10"),
            (f"vllm:gpu_cache_usage_perc{{{m_old}}}", "0.95x10"),
        ), "5m", (
            {"job": "vllm", "model_name": "m", "engine": "0"},
            {"job": "vllm-old", "model_name": "m", "engine": "0"},
        )),
    ))
    A.append(Alert(
        "stepwatch-serving", "VLLMQueueDepthHigh", f"vllm:num_requests_waiting > {t.queue_depth:g}", "5m", "warning",
        "More than " + f"{t.queue_depth:g}" + " requests waiting on {{ $labels.model_name }}",
        "Reference B.6: throughput limited. Add replicas or raise max_num_seqs if the KV cache allows.",
        Case((
            (f"vllm:num_requests_waiting{{{m_new}}}", "80x10"),
            (f"vllm:num_requests_waiting{{{m_ok}}}", "3x10"),
        ), "8m", ({"job": "vllm", "model_name": "m", "engine": "0"},)),
    ))
    ttft_b = "vllm:time_to_first_token_seconds_bucket"
    A.append(Alert(
        "stepwatch-serving", "VLLMTTFTP99High",
        f"histogram_quantile(0.99, sum by (job, model_name, le) (rate({ttft_b}[5m]))) > {_exact(t.ttft_p99_s)}", "5m", "warning",
        "TTFT P99 above " + f"{_exact(t.ttft_p99_s)} s" + " on {{ $labels.model_name }}",
        "Prefill is slow or requests queue: check KV-cache usage, queue depth and preemptions.",
        Case((
            *_slo_histogram(ttft_b, m_new, t.ttft_p99_s, slow=True),
            *_slo_histogram(ttft_b, m_ok, t.ttft_p99_s, slow=False),
        ), "15m", ({"job": "vllm", "model_name": "m"},)),
    ))
    itl_new, itl_old = "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket"
    A.append(Alert(
        "stepwatch-serving", "VLLMInterTokenLatencyHigh",
        f"histogram_quantile(0.99, sum by (job, model_name, le) (rate({itl_new}[5m]) or rate({itl_old}[5m]))) > {_exact(t.itl_p99_s)}",
        "5m", "warning",
        "Inter-token latency P99 above " + f"{_ms(t.itl_p99_s)} ms" + " on {{ $labels.model_name }}",
        "Reference B.6: decode is slow (P99 > 100 ms typical): batch too large for the GPU, memory-bound decode, "
        "or preemptions.",
        Case((
            *_slo_histogram(itl_new, m_new, t.itl_p99_s, slow=True),
            *_slo_histogram(itl_old, m_old, t.itl_p99_s, slow=True),
            *_slo_histogram(itl_new, m_ok, t.itl_p99_s, slow=False),
        ), "15m", ({"job": "vllm", "model_name": "m"}, {"job": "vllm-old", "model_name": "m"})),
    ))
    succ = "vllm:request_success_total"
    A.append(Alert(
        "stepwatch-serving", "VLLMErrorRate",
        f'sum by (job, model_name) (rate({succ}{{finished_reason="error"}}[5m])) '
        f"/ sum by (job, model_name) (rate({succ}[5m])) > 0.05",
        "5m", "warning",
        "More than 5% of requests fail on {{ $labels.model_name }}",
        "Requests finish with reason 'error' (the sheet's vllm:request_count_total does not exist). Check the "
        "server log.",
        Case((
            (f'{succ}{{{m_new},finished_reason="error"}}', "0+10x20"),
            (f'{succ}{{{m_new},finished_reason="length"}}', "0+90x20"),
            (f'{succ}{{{m_ok},finished_reason="error"}}', "0x20"),
            (f'{succ}{{{m_ok},finished_reason="length"}}', "0+100x20"),
        ), "15m", ({"job": "vllm", "model_name": "m"},)),
    ))
    acc, drf = "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total"
    A.append(Alert(
        "stepwatch-serving", "VLLMSpecDecodeAcceptanceLow",
        f"(sum by (job, model_name) (rate({acc}[5m])) / sum by (job, model_name) (rate({drf}[5m])) "
        "or max by (job, model_name) (vllm:spec_decode_draft_acceptance_rate)) < 0.65",
        "10m", "warning",
        "Speculative decoding acceptance below 0.65 on {{ $labels.model_name }}",
        "Reference B.6: wrong draft model for this workload; acceptance = accepted / draft tokens.",
        Case((
            (f"{acc}{{{m_new}}}", "0+40x30"),
            (f"{drf}{{{m_new}}}", "0+100x30"),
            (f"vllm:spec_decode_draft_acceptance_rate{{{m_old}}}", "0.5x30"),
            (f"{acc}{{{m_ok}}}", "0+90x30"),
            (f"{drf}{{{m_ok}}}", "0+100x30"),
        ), "20m", ({"job": "vllm", "model_name": "m"}, {"job": "vllm-old", "model_name": "m"})),
    ))
    A.append(Alert(
        "stepwatch-serving", "VLLMPreemptions", "sum by (job, model_name) (rate(vllm:num_preemptions_total[5m])) > 0",
        "5m", "warning",
        "vLLM is preempting requests on {{ $labels.model_name }}",
        "KV-cache cascade under way (reference B.6): preempted requests re-prefill from scratch.",
        Case((
            (f"vllm:num_preemptions_total{{{m_new}}}", "0+2x20"),
            (f"vllm:num_preemptions_total{{{m_ok}}}", "0x20"),
        ), "15m", ({"job": "vllm", "model_name": "m"},)),
    ))
    return A


# ---------------------------------------------------------------------------------------------


def rules_doc(alerts: list[Alert]) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for a in alerts:
        rule: dict[str, Any] = {"alert": a.name, "expr": a.expr}
        if a.for_ != "0m":
            rule["for"] = a.for_
        rule["labels"] = {"severity": a.severity, **a.labels}
        rule["annotations"] = {"summary": a.summary, "description": a.description}
        groups.setdefault(a.group, []).append(rule)
    return {"groups": [{"name": g, "rules": rs} for g, rs in groups.items()]}


_TMPL = re.compile(r"\{\{\s*\$labels\.([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_VALUE = re.compile(r"\{\{\s*\$value\s*\}\}")


def _render(text: str, labels: dict[str, str], value: str | None) -> str:
    out = _TMPL.sub(lambda m: labels.get(m.group(1), "<no value>"), text)
    if value is not None:
        out = _VALUE.sub(value, out)
    return out


def _value_for(alert: Alert, labels: dict[str, str]) -> str | None:
    # Only GPUXIDError templates $value; its firing series holds the XID (79).
    if not _VALUE.search(alert.summary + alert.description):
        return None
    for sel, values in alert.case.series:
        if all(f'{k}="{v}"' in sel for k, v in labels.items()):
            return values.split()[-1].split("x")[0]
    return None


def tests_doc(alerts: list[Alert], rule_file: str, *, with_queries: bool = True) -> dict[str, Any]:
    """The promtool test file: one case per alert, plus (``with_queries``) one case evaluating every
    dashboard query on known input (:mod:`stepwatch.rules.proofs`)."""
    tests = []
    for a in alerts:
        c = a.case
        exp = []
        for lab in c.firing:
            labels = {**lab, "severity": a.severity, **a.labels}
            ann = {
                "summary": _render(a.summary, labels, _value_for(a, lab)),
                "description": _render(a.description, labels, None),
            }
            exp.append({"exp_labels": labels, "exp_annotations": ann})
        art: list[dict[str, Any]] = [{"eval_time": c.eval_time, "alertname": a.name, "exp_alerts": exp}]
        if c.quiet_time:
            art.insert(0, {"eval_time": c.quiet_time, "alertname": a.name, "exp_alerts": []})
        tests.append({
            "name": f"{a.name}: fires for the bad series only",
            "interval": c.interval,
            "input_series": [{"series": s, "values": v} for s, v in c.series],
            "alert_rule_test": art,
        })
    if with_queries:
        from . import proofs

        tests.append(proofs.promtool_case())
    return {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests}

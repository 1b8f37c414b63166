"""The PromQL the dashboard panels run, in one place; the tests run exactly these strings.

Training queries use stepwatch's names (:mod:`stepwatch.exporters.names`); GPU queries the DCGM
exporter's names (stepwatch exports the same); serving queries vLLM's own names, the current
one first with an ``or`` fallback to the old one (vLLM renamed ``gpu_cache_usage_perc`` to
``kv_cache_usage_perc`` and ``time_per_output_token_seconds`` to ``inter_token_latency_seconds``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..exporters import names as N

STEP = N.STEP_SECONDS.name
STEPS = N.STEPS_TOTAL.name


@dataclass(frozen=True, slots=True)
class Query:
    key: str
    title: str
    expr: str
    legend: str
    unit: str  # Grafana unit id
    section: str  # training | gpu | serving
    # Series labels a result carries per rank (for the end-to-end test); () = not per rank.
    per_rank: bool = False


def _q(p: float, window: str = "1m") -> str:
    return f"histogram_quantile({p}, sum by (job, rank, le) (rate({STEP}_bucket[{window}])))"


TRAINING: tuple[Query, ...] = (
    Query("step_p50", "Step time P50 by rank", _q(0.5), "rank {{rank}} P50", "s", "training", True),
    Query("step_p99", "Step time P99 by rank", _q(0.99), "rank {{rank}} P99", "s", "training", True),
    Query("steps_rate", "Steps per second", f"rate({STEPS}[1m])", "rank {{rank}}", "ops", "training", True),
    Query("mfu", "MFU", N.MFU.name, "rank {{rank}}", "percentunit", "training", True),
    Query("grad_norm", "Gradient norm", N.GRAD_NORM.name, "rank {{rank}}", "none", "training", True),
    Query(
        "data_wait", "Data wait per step",
        f"rate({N.DATA_WAIT.name}[1m]) / rate({STEPS}[1m])", "rank {{rank}}", "s", "training", True,
    ),
    Query("allreduce", "AllReduce time (avg 1m)", f"avg_over_time({N.ALLREDUCE_MS.name}[1m])", "rank {{rank}}", "ms", "training", True),
    Query("overlap", "Comm overlapped with backward", N.OVERLAP.name, "rank {{rank}}", "percentunit", "training", True),
    Query(
        "exposed_comm", "Exposed comm share of step time",
        f"rate({N.COMM_EXPOSED.name}[1m]) / rate({STEP}_sum[1m])", "rank {{rank}}", "percentunit", "training", True,
    ),
    Query("busbw", "AllReduce bus bandwidth", N.BUSBW.name, "rank {{rank}}", "GBs", "training", True),
    Query("tokens", "Tokens per second", f"rate({N.TOKENS_TOTAL.name}[1m])", "rank {{rank}}", "none", "training", True),
    Query(
        "compute_per_step", "Compute per step (step - exposed comm - data wait): stragglers stand out here",
        f"(rate({STEP}_sum[1m]) - rate({N.COMM_EXPOSED.name}[1m]) - rate({N.DATA_WAIT.name}[1m])) / rate({STEPS}[1m])",
        "rank {{rank}}", "s", "training", True,
    ),
    Query(
        "stragglers", "Straggler findings (10m)",
        f'sum by (job, rank) (increase({N.FINDINGS_TOTAL.name}{{kind="straggler"}}[10m]))',
        "reported by rank {{rank}}", "none", "training",
    ),
    Query(
        "findings", "Findings by kind (10m)",
        f"sum by (job, kind, severity) (increase({N.FINDINGS_TOTAL.name}[10m]))", "{{kind}} ({{severity}})", "none", "training",
    ),
    Query(
        "dropped", "Exporter drops (10m)",
        f"sum by (job, rank, exporter) (increase({N.DROPPED_TOTAL.name}[10m]))", "rank {{rank}} {{exporter}}", "none", "training",
    ),
)

GPU: tuple[Query, ...] = (
    Query("sm_active", "SM active (ratio)", "DCGM_FI_PROF_SM_ACTIVE", "{{Hostname}} GPU {{gpu}}", "percentunit", "gpu"),
    Query("tensor_active", "Tensor pipe active (ratio)", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "{{Hostname}} GPU {{gpu}}", "percentunit", "gpu"),
    Query("dram_active", "DRAM active (ratio)", "DCGM_FI_PROF_DRAM_ACTIVE", "{{Hostname}} GPU {{gpu}}", "percentunit", "gpu"),
    Query("gpu_temp", "GPU temperature", "DCGM_FI_DEV_GPU_TEMP", "{{Hostname}} GPU {{gpu}}", "celsius", "gpu"),
    Query("power", "Power draw", "DCGM_FI_DEV_POWER_USAGE", "{{Hostname}} GPU {{gpu}}", "watt", "gpu"),
    Query(
        "throttle", "Clock throttle reasons active (decoded)",
        f'{N.GPU_THROTTLE.name}{{reason!="gpu_idle"}} == 1', "{{Hostname}} GPU {{gpu}} {{reason}}", "none", "gpu",
    ),
    Query("ecc_sbe", "Correctable ECC errors (1h)", "increase(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL[1h])", "{{Hostname}} GPU {{gpu}}", "none", "gpu"),
    Query("xid", "Last XID error", "DCGM_FI_DEV_XID_ERRORS", "{{Hostname}} GPU {{gpu}}", "none", "gpu"),
    Query("fb_free", "Framebuffer free", "DCGM_FI_DEV_FB_FREE", "{{Hostname}} GPU {{gpu}}", "decmbytes", "gpu"),
)

SERVING: tuple[Query, ...] = (
    Query(
        "ttft_p99", "TTFT P99 (5m)",
        "histogram_quantile(0.99, sum by (job, model_name, le) (rate(vllm:time_to_first_token_seconds_bucket[5m])))",
        "{{model_name}}", "s", "serving",
    ),
    Query(
        "itl_p50", "Inter-token latency P50 (5m)",
        "histogram_quantile(0.5, sum by (job, model_name, le) (rate(vllm:inter_token_latency_seconds_bucket[5m]) "
        "or rate(vllm:time_per_output_token_seconds_bucket[5m])))",
        "{{model_name}}", "s", "serving",
    ),
    Query(
        "itl_p99", "Inter-token latency P99 (5m)",
        "histogram_quantile(0.99, sum by (job, model_name, le) (rate(vllm:inter_token_latency_seconds_bucket[5m]) "
        "or rate(vllm:time_per_output_token_seconds_bucket[5m])))",
        "{{model_name}}", "s", "serving",
    ),
    Query(
        "kv_cache", "KV cache usage (alert > 0.82)",
        "vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc", "{{model_name}} engine {{engine}}", "percentunit", "serving",
    ),
    Query("waiting", "Requests waiting", "vllm:num_requests_waiting", "{{model_name}} engine {{engine}}", "none", "serving"),
    Query("running", "Requests running", "vllm:num_requests_running", "{{model_name}} engine {{engine}}", "none", "serving"),
    Query(
        "gen_tokens", "Generated tokens per second",
        "sum by (job, model_name) (rate(vllm:generation_tokens_total[1m]))", "{{model_name}}", "none", "serving",
    ),
    Query(
        "error_rate", "Request error rate (5m)",
        'sum by (job, model_name) (rate(vllm:request_success_total{finished_reason="error"}[5m])) '
        "/ sum by (job, model_name) (rate(vllm:request_success_total[5m]))",
        "{{model_name}}", "percentunit", "serving",
    ),
    Query(
        "preemptions", "Preemptions per second",
        "sum by (job, model_name) (rate(vllm:num_preemptions_total[5m]))", "{{model_name}}", "none", "serving",
    ),
)

ALL: tuple[Query, ...] = TRAINING + GPU + SERVING
BY_KEY = {q.key: q for q in ALL}

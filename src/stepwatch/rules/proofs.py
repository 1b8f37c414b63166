"""Known input and the hand-computed answer for every dashboard query, as one
``promql_expr_test`` case that ships in the promtool test file.

Series are sampled every 15 s and evaluated at 10m, so a ``[1m]`` window holds 4-5 samples of a
linear counter: ``rate`` is exact under both Prometheus 2 (closed windows) and 3 (left-open).
Expected values are worked out by hand next to each query (histogram_quantile interpolates
linearly inside the bucket that holds the rank). promtool 2.42 compares values exactly, so
arithmetic on rates is written as the same float operations Prometheus does (``_r(delta)`` is a
``rate`` over a 1m window whose counter grew by ``delta``), and counter increments are binary
fractions, so the series values carry no rounding.
"""

from __future__ import annotations

from typing import Any

from .queries import ALL

INTERVAL = "15s"
EVAL_TIME = "10m"

T = 'job="train",rank="%s"'
G = 'job="dcgm",Hostname="node1",gpu="0"'
V = 'job="vllm",model_name="m",engine="0"'
VO = 'job="vllm-old",model_name="m",engine="0"'

# (series, values): 61 samples (0..10m) each.
SERIES: tuple[tuple[str, str], ...] = (
    # rank 0: 1 step/s, every step in (0, 0.1]; rank 1: 2 steps/s, every step in (0.1, 0.25].
    (f"training_steps_total{{{T % 0}}}", "0+15x60"),
    (f"training_steps_total{{{T % 1}}}", "0+30x60"),
    (f'training_step_seconds_bucket{{{T % 0},le="0.1"}}', "0+15x60"),
    (f'training_step_seconds_bucket{{{T % 0},le="0.25"}}', "0+15x60"),
    (f'training_step_seconds_bucket{{{T % 0},le="+Inf"}}', "0+15x60"),
    (f'training_step_seconds_bucket{{{T % 1},le="0.1"}}', "0x60"),
    (f'training_step_seconds_bucket{{{T % 1},le="0.25"}}', "0+30x60"),
    (f'training_step_seconds_bucket{{{T % 1},le="+Inf"}}', "0+30x60"),
    (f"training_step_seconds_sum{{{T % 0}}}", "0+1.5x60"),  # 0.1 s/s, +6 per minute
    (f"training_step_seconds_sum{{{T % 1}}}", "0+6x60"),  # 0.4 s/s, +24 per minute
    (f"training_mfu{{{T % 0}}}", "0.4x60"),
    (f"training_mfu{{{T % 1}}}", "0.3x60"),
    (f"train_grad_norm{{{T % 0}}}", "1.5x60"),
    (f"train_grad_norm{{{T % 1}}}", "2.5x60"),
    (f"training_data_wait_seconds_total{{{T % 0}}}", "0+0.25x60"),  # +1 per minute
    (f"training_data_wait_seconds_total{{{T % 1}}}", "0+1x60"),  # +4 per minute
    (f"allreduce_time_ms{{{T % 0}}}", "3x60"),
    (f"allreduce_time_ms{{{T % 1}}}", "5x60"),
    (f"training_comm_overlap_ratio{{{T % 0}}}", "0.9x60"),
    (f"training_comm_overlap_ratio{{{T % 1}}}", "0.6x60"),
    (f"training_comm_exposed_seconds_total{{{T % 0}}}", "0+0.375x60"),  # +1.5 per minute
    (f"training_comm_exposed_seconds_total{{{T % 1}}}", "0+3x60"),  # +12 per minute
    (f"training_allreduce_busbw_gbps{{{T % 0}}}", "100x60"),
    (f"training_allreduce_busbw_gbps{{{T % 1}}}", "120x60"),
    (f"training_tokens_total{{{T % 0}}}", "0+1500x60"),  # 100/s
    (f"training_tokens_total{{{T % 1}}}", "0+3000x60"),  # 200/s
    (f'stepwatch_findings_total{{{T % 0},kind="straggler",severity="warning"}}', "0x20 1x40"),
    (f'stepwatch_findings_total{{{T % 1},kind="data_loading",severity="warning"}}', "0x10 2x50"),
    (f'stepwatch_exporter_dropped_total{{{T % 0},exporter="otlp"}}', "0x20 5x40"),
    # GPU
    (f"DCGM_FI_PROF_SM_ACTIVE{{{G}}}", "0.8x60"),
    (f"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{G}}}", "0.6x60"),
    (f"DCGM_FI_PROF_DRAM_ACTIVE{{{G}}}", "0.3x60"),
    (f"DCGM_FI_DEV_GPU_TEMP{{{G}}}", "65x60"),
    (f"DCGM_FI_DEV_POWER_USAGE{{{G}}}", "300x60"),
    (f'stepwatch_gpu_clocks_event_active{{{G},reason="gpu_idle"}}', "1x60"),
    (f'stepwatch_gpu_clocks_event_active{{{G},reason="sw_power_cap"}}', "1x60"),
    (f'stepwatch_gpu_clocks_event_active{{{G},reason="hw_slowdown"}}', "0x60"),
    (f"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{{G}}}", "0+1x60"),
    (f"DCGM_FI_DEV_XID_ERRORS{{{G}}}", "0x60"),
    (f"DCGM_FI_DEV_FB_FREE{{{G}}}", "40000x60"),
    # serving: current names on job vllm, old names on job vllm-old
    (f'vllm:time_to_first_token_seconds_bucket{{{V},le="1"}}', "0+15x60"),
    (f'vllm:time_to_first_token_seconds_bucket{{{V},le="5"}}', "0+30x60"),
    (f'vllm:time_to_first_token_seconds_bucket{{{V},le="+Inf"}}', "0+30x60"),
    (f'vllm:inter_token_latency_seconds_bucket{{{V},le="0.05"}}', "0+30x60"),
    (f'vllm:inter_token_latency_seconds_bucket{{{V},le="0.5"}}', "0+30x60"),
    (f'vllm:inter_token_latency_seconds_bucket{{{V},le="+Inf"}}', "0+30x60"),
    (f'vllm:time_per_output_token_seconds_bucket{{{VO},le="0.05"}}', "0x60"),
    (f'vllm:time_per_output_token_seconds_bucket{{{VO},le="0.5"}}', "0+30x60"),
    (f'vllm:time_per_output_token_seconds_bucket{{{VO},le="+Inf"}}', "0+30x60"),
    (f"vllm:kv_cache_usage_perc{{{V}}}", "0.4x60"),
    (f"vllm:gpu_cache_usage_perc{{{VO}}}", "0.7x60"),
    (f"vllm:num_requests_waiting{{{V}}}", "4x60"),
    (f"vllm:num_requests_running{{{V}}}", "8x60"),
    (f"vllm:generation_tokens_total{{{V}}}", "0+150x60"),  # 10/s
    (f'vllm:request_success_total{{{V},finished_reason="error"}}', "0+3x60"),  # 0.2/s
    (f'vllm:request_success_total{{{V},finished_reason="length"}}', "0+12x60"),  # 0.8/s
    (f"vllm:num_preemptions_total{{{V}}}", "0+1.5x60"),  # 0.1/s
)

_t0, _t1 = "{%s}" % (T % 0), "{%s}" % (T % 1)
_vm = '{job="vllm",model_name="m"}'
_vo = '{job="vllm-old",model_name="m"}'



def _r(delta: float) -> float:
    """rate() over [1m] of a linear counter that grew by ``delta`` in that minute."""
    return delta / 60


# query key -> [(labels, value)]
EXPECTED: dict[str, list[tuple[str, float]]] = {
    # rank 0: all in (0, 0.1] -> 0.1 * q; rank 1: all in (0.1, 0.25] -> 0.1 + 0.15 * q
    "step_p50": [(_t0, 0.05), (_t1, 0.175)],
    "step_p99": [(_t0, 0.099), (_t1, 0.2485)],
    "steps_rate": [(_t0, 1.0), (_t1, 2.0)],
    "mfu": [("training_mfu" + _t0, 0.4), ("training_mfu" + _t1, 0.3)],
    "grad_norm": [("train_grad_norm" + _t0, 1.5), ("train_grad_norm" + _t1, 2.5)],
    # wait growth / step growth per minute: 1/60, 4/120
    "data_wait": [(_t0, _r(1) / _r(60)), (_t1, _r(4) / _r(120))],
    "allreduce": [(_t0, 3.0), (_t1, 5.0)],
    "overlap": [("training_comm_overlap_ratio" + _t0, 0.9), ("training_comm_overlap_ratio" + _t1, 0.6)],
    # exposed growth / step-seconds growth: 1.5/6 = 0.25, 12/24 = 0.5
    "exposed_comm": [(_t0, _r(1.5) / _r(6)), (_t1, _r(12) / _r(24))],
    "busbw": [("training_allreduce_busbw_gbps" + _t0, 100.0), ("training_allreduce_busbw_gbps" + _t1, 120.0)],
    "tokens": [(_t0, 100.0), (_t1, 200.0)],
    # (step - exposed - wait) / steps, per minute: (6-1.5-1)/60 = 0.0583, (24-12-4)/120 = 0.0667
    "compute_per_step": [(_t0, (_r(6) - _r(1.5) - _r(1)) / _r(60)), (_t1, (_r(24) - _r(12) - _r(4)) / _r(120))],
    "stragglers": [(_t0, 1.0)],
    "findings": [
        ('{job="train",kind="straggler",severity="warning"}', 1.0),
        ('{job="train",kind="data_loading",severity="warning"}', 2.0),
    ],
    "dropped": [('{job="train",rank="0",exporter="otlp"}', 5.0)],
    "sm_active": [(f"DCGM_FI_PROF_SM_ACTIVE{{{G}}}", 0.8)],
    "tensor_active": [(f"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{G}}}", 0.6)],
    "dram_active": [(f"DCGM_FI_PROF_DRAM_ACTIVE{{{G}}}", 0.3)],
    "gpu_temp": [(f"DCGM_FI_DEV_GPU_TEMP{{{G}}}", 65.0)],
    "power": [(f"DCGM_FI_DEV_POWER_USAGE{{{G}}}", 300.0)],
    # gpu_idle (bit 0x1) is not a throttle: only the power cap shows.
    "throttle": [(f'stepwatch_gpu_clocks_event_active{{{G},reason="sw_power_cap"}}', 1.0)],
    # +1 per 15 s since t=0: 40 by 10m (the window reaches back before the first sample)
    "ecc_sbe": [(f"{{{G}}}", 40.0)],
    "xid": [(f"DCGM_FI_DEV_XID_ERRORS{{{G}}}", 0.0)],
    "fb_free": [(f"DCGM_FI_DEV_FB_FREE{{{G}}}", 40000.0)],
    # 2/s, half <= 1 s: rank 0.99*2 = 1.98 lies in (1, 5] at (1.98-1)/1 -> 1 + 4 * 0.98
    "ttft_p99": [(_vm, 4.92)],
    # new name: all in (0, 0.05]; old name: all in (0.05, 0.5]
    "itl_p50": [(_vm, 0.025), (_vo, 0.275)],
    "itl_p99": [(_vm, 0.0495), (_vo, 0.4955)],
    "kv_cache": [(f"vllm:kv_cache_usage_perc{{{V}}}", 0.4), (f"vllm:gpu_cache_usage_perc{{{VO}}}", 0.7)],
    "waiting": [(f"vllm:num_requests_waiting{{{V}}}", 4.0)],
    "running": [(f"vllm:num_requests_running{{{V}}}", 8.0)],
    "gen_tokens": [(_vm, 10.0)],
    "error_rate": [(_vm, 0.2)],
    "preemptions": [(_vm, 0.1)],
}


def promtool_case() -> dict[str, Any]:
    missing = {q.key for q in ALL} - set(EXPECTED)
    if missing:
        raise RuntimeError(f"dashboard queries without a proof: {sorted(missing)}")
    return {
        "name": "every dashboard query on known input",
        "interval": INTERVAL,
        "input_series": [{"series": s, "values": v} for s, v in SERIES],
        "promql_expr_test": [
            {
                "expr": q.expr,
                "eval_time": EVAL_TIME,
                "exp_samples": [{"labels": lab, "value": val} for lab, val in EXPECTED[q.key]],
            }
            for q in ALL
        ],
    }

"""vLLM's metric names, both generations, and the ``stepwatch_serving_*`` names we export.

Sources: vLLM 0.32.0's ``/metrics`` (real scrapes in tests/fixtures/vllm/metrics-0.32.0-*.txt)
and the reference sheet's B.6 table, which lists the older (v0 engine) names. Renames since the
sheet: ``vllm:gpu_cache_usage_perc`` -> ``vllm:kv_cache_usage_perc`` and
``vllm:time_per_output_token_seconds`` -> ``vllm:inter_token_latency_seconds``;
``vllm:spec_decode_draft_acceptance_rate`` and ``vllm:cpu_cache_usage_perc`` are gone
(acceptance is now Δ``num_accepted_tokens_total`` / Δ``num_draft_tokens_total``).

Each logical metric maps to a tuple of sample names, newest first: the first one present in a
scrape wins, so a server of either generation reads the same.
"""

from __future__ import annotations

# -- gauges ----------------------------------------------------------------------------------
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # 0-1 despite "perc"
# v0 only: a gauge computed by the server over its own interval; used when the counters are absent.
PREFIX_HIT_RATE_GAUGE = ("vllm:gpu_prefix_cache_hit_rate",)
SPEC_ACCEPT_GAUGE = ("vllm:spec_decode_draft_acceptance_rate",)

# -- counters (sample names with their _total) ------------------------------------------------
GEN_TOKENS = ("vllm:generation_tokens_total",)
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
PREEMPTIONS = ("vllm:num_preemptions_total",)
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
SPEC_ACCEPTED = ("vllm:spec_decode_num_accepted_tokens_total",)
SPEC_DRAFT = ("vllm:spec_decode_num_draft_tokens_total",)
REQUEST_SUCCESS = ("vllm:request_success_total",)  # label finished_reason: stop, length, abort, error, ...
HTTP_REQUESTS = ("http_requests_total",)  # prometheus-fastapi-instrumentator, label status: 2xx..5xx

# -- histograms (base names; samples are <base>_bucket/_count/_sum) ----------------------------
TTFT = ("vllm:time_to_first_token_seconds",)
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
E2E = ("vllm:e2e_request_latency_seconds",)
# One observation per engine step: its _count moves whenever the engine steps.
ITERATION_TOKENS = ("vllm:iteration_tokens_total", "vllm:iteration_tokens")

HISTOGRAMS = {"ttft": TTFT, "itl": ITL, "e2e": E2E}

# The only sample names the watcher keeps from a scrape (the rest of /metrics is ~600 lines of
# python_gc, http sizes and per-request histograms it does not need).
_BASES = TTFT + ITL + E2E + ITERATION_TOKENS
KEEP: frozenset[str] = frozenset(
    RUNNING + WAITING + KV_USAGE + PREFIX_HIT_RATE_GAUGE + SPEC_ACCEPT_GAUGE + GEN_TOKENS
    + PROMPT_TOKENS + PREEMPTIONS + PREFIX_HITS + PREFIX_QUERIES + SPEC_ACCEPTED + SPEC_DRAFT
    + REQUEST_SUCCESS + HTTP_REQUESTS
    + tuple(b + s for b in _BASES for s in ("_bucket", "_count", "_sum"))
)

# Labels that name a series (one engine of one model on one server). Others (finished_reason,
# le, status, handler...) are aggregated or read explicitly.
SERIES_LABELS = ("engine", "model_name")

# -- what we export (stepwatch_serving_*; the OTel SDK rejects ':' and re-using vLLM's names
# would duplicate its series where Prometheus scrapes both) -----------------------------------
PREFIX = "stepwatch_serving_"
OUT_TTFT = PREFIX + "ttft_seconds"
OUT_ITL = PREFIX + "inter_token_latency_seconds"
OUT_E2E = PREFIX + "e2e_latency_seconds"
OUT_RUNNING = PREFIX + "requests_running"
OUT_WAITING = PREFIX + "requests_waiting"
OUT_KV = PREFIX + "kv_cache_usage_ratio"
OUT_PREEMPT_RATE = PREFIX + "preemptions_per_second"
OUT_PREEMPT = PREFIX + "preemptions"
OUT_PREFIX_HIT = PREFIX + "prefix_cache_hit_ratio"
OUT_GEN_TPS = PREFIX + "generation_tokens_per_second"
OUT_PROMPT_TPS = PREFIX + "prompt_tokens_per_second"
OUT_FINISHED = PREFIX + "requests_finished_per_second"  # label reason
OUT_ERROR_RATIO = PREFIX + "error_ratio"
OUT_SPEC_ACCEPT = PREFIX + "spec_decode_acceptance_ratio"
OUT_IN_FLIGHT = PREFIX + "requests_in_flight"
OUT_SINCE_PROGRESS = PREFIX + "seconds_since_progress"
OUT_SCRAPE_ERRORS = PREFIX + "scrape_errors"

OUT_HISTOGRAMS = {"ttft": OUT_TTFT, "itl": OUT_ITL, "e2e": OUT_E2E}

EXPORTED: dict[str, str] = {
    OUT_TTFT: "Time to first token, seconds; labels quantile (0.5, 0.99) and window.",
    OUT_ITL: "Inter-token latency (was time per output token), seconds; labels quantile, window.",
    OUT_E2E: "End-to-end request latency, seconds; labels quantile, window.",
    OUT_RUNNING: "Requests running in the engine (vllm:num_requests_running).",
    OUT_WAITING: "Requests waiting to be scheduled (vllm:num_requests_waiting).",
    OUT_KV: "KV-cache blocks in use, 0-1 (vllm:kv_cache_usage_perc; > 0.82 = cascade risk).",
    OUT_PREEMPT: "Preemptions since the server started (vllm:num_preemptions_total).",
    OUT_PREEMPT_RATE: "Preemptions per second over the window.",
    OUT_PREFIX_HIT: "Prefix-cache hit ratio over the window (Δhits / Δqueries).",
    OUT_GEN_TPS: "Generated tokens per second over the window.",
    OUT_PROMPT_TPS: "Prompt tokens per second over the window.",
    OUT_FINISHED: "Finished requests per second by reason (label reason: stop, length, abort, error...).",
    OUT_ERROR_RATIO: "Share of finished requests with reason error, or of HTTP responses 5xx, over the window.",
    OUT_SPEC_ACCEPT: "Speculative-decoding acceptance over the window (Δaccepted / Δdraft tokens).",
    OUT_IN_FLIGHT: "Requests in flight at the API server (/load; needs --enable-server-load-tracking).",
    OUT_SINCE_PROGRESS: "Seconds since the engine last produced a token or stepped.",
    OUT_SCRAPE_ERRORS: "Scrapes or /metrics lines that could not be read, since start.",
}

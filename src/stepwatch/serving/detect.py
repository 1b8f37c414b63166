"""Serving findings from a window of scrapes: KV-cache cascade, TTFT/ITL/e2e P99, queue, a full
batch, prefill rate, spec-decode, errors.

Thresholds come from the reference sheet's B.6 table (``profiling-quick-reference.txt``) unless
marked as stepwatch's own default. Each (kind, server, engine series) fires at most once per
``cooldown_s``, so a server that stays over a threshold does not flood the findings file; the
inter-token latency, e2e, batch-full and prefill-rate rows fire once per episode (again only after
a scrape showed the condition gone). ``data["subject"]`` (the server, its engine, and for the
episode rows the episode) is what the watcher's finding limiter keeps apart.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..analysis.kinds import make_finding
from ..record import Finding
from . import names as N
from .parse import Labels
from .slo import Window


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    # B.6: "vllm:gpu_cache_usage_perc > 0.82 -> CASCADE RISK" ("Alert at 0.82 to give headroom").
    kv_cache: float = 0.82
    # stepwatch default: "sustained" = above the threshold on every scrape for this long.
    kv_sustain_s: float = 30.0
    # B.6: "vllm:num_requests_waiting > 50 -> throughput limited".
    queue_depth: float = 50.0
    # B.6: "P99 > SLO threshold": the SLO is the operator's; None = no TTFT finding.
    ttft_p99_s: float | None = None
    # B.6: "spec_decode_draft_acceptance_rate < 0.65 -> wrong draft model for this workload".
    spec_acceptance: float = 0.65
    # stepwatch default: fewer draft tokens than this in the window say nothing about acceptance.
    spec_min_draft_tokens: float = 100.0
    # stepwatch default: B.7's error-rate query has no threshold; 5% of finished requests.
    error_ratio: float = 0.05
    # stepwatch default: no error ratio from fewer finished requests than this.
    error_min_requests: float = 10.0
    cooldown_s: float = 60.0
    # B.6: "vllm:time_per_output_token_seconds ... P99 > 100ms typical" (now inter_token_latency).
    itl_p99_s: float = 0.100
    # B.6: "vllm:e2e_request_latency_seconds ... P99 per SLO": the operator's; None = off.
    e2e_p99_s: float | None = None
    # B.6: "vllm:num_requests_running ... Near max_num_seqs": the server's cap (its
    # --max-num-seqs); None = unknown, the row is off (no metric carries it).
    max_num_seqs: int | None = None
    # stepwatch: prompt tokens/s below this share of their median over ``prefill_window_s``
    # while requests wait; at least ``prefill_min_intervals`` scrape intervals make a median.
    prefill_drop: float = 0.5
    prefill_window_s: float = 300.0
    prefill_min_intervals: int = 5

    def __post_init__(self) -> None:
        for name in ("kv_cache", "spec_acceptance", "error_ratio"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be within (0, 1], got {v!r}")
        for name in ("kv_sustain_s", "queue_depth", "spec_min_draft_tokens", "error_min_requests", "cooldown_s"):
            if not getattr(self, name) >= 0:  # nan too
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.ttft_p99_s is not None and not self.ttft_p99_s > 0:
            raise ValueError(f"ttft_p99_s must be > 0 seconds (or None for off), got {self.ttft_p99_s!r}")
        if self.e2e_p99_s is not None and not self.e2e_p99_s > 0:
            raise ValueError(f"e2e_p99_s must be > 0 seconds (or None for off), got {self.e2e_p99_s!r}")
        if not self.itl_p99_s > 0:
            raise ValueError(f"itl_p99_s must be > 0 seconds, got {self.itl_p99_s!r}")
        if self.max_num_seqs is not None and (isinstance(self.max_num_seqs, bool) or int(self.max_num_seqs) != self.max_num_seqs
                                              or self.max_num_seqs < 1):
            raise ValueError(f"max_num_seqs must be an integer >= 1 (or None for unknown), got {self.max_num_seqs!r}")
        if not 0.0 < self.prefill_drop < 1.0:
            raise ValueError(f"prefill_drop must be within (0, 1), got {self.prefill_drop!r}")
        if not self.prefill_window_s > 0:
            raise ValueError(f"prefill_window_s must be > 0 seconds, got {self.prefill_window_s!r}")
        if self.prefill_min_intervals < 2:
            raise ValueError(f"prefill_min_intervals must be >= 2, got {self.prefill_min_intervals!r}")


def _subject(server: str, key: Labels) -> str:
    """What the finding limiter (analysis/ratelimit.py) keeps apart within a kind: the server and
    the engine (and the HTTP source of the 5xx ratio)."""
    d = dict(key)
    return " ".join([server] + [f"{k}={d[k]}" for k in ("engine", "source") if k in d])


def _series_data(server: str, key: Labels) -> dict[str, Any]:
    return {"server": server, **dict(key), "subject": _subject(server, key)}


def _secs(s: float) -> str:
    """A window's length as a summary says it: whole seconds, or tenths below 10 s (a 0.5 s
    scrape window read "over 0 s")."""
    return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"


def _who(server: str, key: Labels) -> str:
    d = dict(key)
    parts = [f"engine {d['engine']}" if "engine" in d else "", d.get("model_name", ""), server]
    return ", ".join(p for p in parts if p)


class Detectors:
    def __init__(self, th: Thresholds) -> None:
        self.th = th
        self._last_fired: dict[tuple[str, str, Labels], float] = {}
        # (server, series) -> (mono when KV usage went over, preemptions then)
        self._kv_over: dict[tuple[str, Labels], tuple[float, float]] = {}
        # (kind, server, series) in a bad episode: fired once, silent until a scrape shows it gone.
        self._episodes: set[tuple[str, str, Labels]] = set()
        # (server, series) -> (mono, prompt tokens/s) of the scrape intervals of the prefill window.
        self._prompt_rates: dict[tuple[str, Labels], deque[tuple[float, float]]] = {}
        # (kind, server, series) -> (number, mono it began) of the episode findings' limiter group.
        self._groups: dict[tuple[str, str, Labels], tuple[int, float]] = {}

    def _episode(self, kind: str, server: str, key: Labels, bad: bool) -> bool:
        """True when a bad episode starts now; a healthy reading ends it."""
        k = (kind, server, key)
        if not bad:
            self._episodes.discard(k)
            return False
        if k in self._episodes:
            return False
        self._episodes.add(k)
        return True

    def _episode_data(self, kind: str, server: str, key: Labels, now: float) -> dict[str, Any]:
        """The series data of a finding that opens an episode, with a subject of its own, so the
        finding limiter reports it at once instead of counting it in the previous episode; an
        episode that begins less than ``cooldown_s`` after the previous one began (a condition
        that flaps) shares its subject: the limiter counts it there, and says so when it ends."""
        k = (kind, server, key)
        n, began = self._groups.get(k, (0, -float("inf")))
        if now - began >= self.th.cooldown_s:
            n, began = n + 1, now
            self._groups[k] = (n, began)
        data = _series_data(server, key)
        data["subject"] = f"{data['subject']} episode {n}"
        return data

    def _may_fire(self, kind: str, server: str, key: Labels, now: float) -> bool:
        last = self._last_fired.get((kind, server, key))
        if last is not None and now - last < self.th.cooldown_s:
            return False
        self._last_fired[(kind, server, key)] = now
        return True

    def check(self, server: str, latest: Window, slo: Window) -> list[Finding]:
        """``latest``: the last two scrapes (gauges, the KV timer); ``slo``: the SLO window."""
        out: list[Finding] = []
        now, wall = latest.new.mono, latest.new.wall
        th = self.th
        preempt_total = latest.gauge(N.PREEMPTIONS)

        # -- KV-cache cascade (B.6) -----------------------------------------------------------
        for key, usage in latest.gauge(N.KV_USAGE).items():
            sk = (server, key)
            if usage <= th.kv_cache:
                self._kv_over.pop(sk, None)
                continue
            since, pre0 = self._kv_over.setdefault(sk, (now, preempt_total.get(key, 0.0)))
            held = now - since
            if held < th.kv_sustain_s:
                continue
            rising = preempt_total.get(key, 0.0) - pre0
            if not self._may_fire("kv_cache_cascade", server, key, now):
                continue
            sev = "critical" if rising > 0 else "warning"
            what = (f"{rising:.0f} preemption(s) since it crossed: requests are being evicted and re-prefilled"
                    if rising > 0 else "no preemptions yet")
            out.append(make_finding(
                "kv_cache_cascade", rank=0, step=None, when=wall, severity=sev,
                summary=f"KV-cache usage {usage:.2f} > {th.kv_cache} for {held:.0f} s ({what}) on {_who(server, key)}",
                data={**_series_data(server, key), "kv_cache_usage": usage, "threshold": th.kv_cache,
                      "sustained_s": round(held, 1), "preemptions_since": rising,
                      "preemptions_total": preempt_total.get(key)},
            ))

        # -- queue depth (B.6) ----------------------------------------------------------------
        for key, waiting in latest.gauge(N.WAITING).items():
            if waiting > th.queue_depth and self._may_fire("queue_depth", server, key, now):
                running = latest.gauge(N.RUNNING).get(key)
                out.append(make_finding(
                    "queue_depth", rank=0, step=None, when=wall,
                    summary=f"{waiting:.0f} requests waiting (> {th.queue_depth:g}), {running or 0:.0f} running, on {_who(server, key)}",
                    data={**_series_data(server, key), "waiting": waiting, "running": running, "threshold": th.queue_depth},
                ))

        # -- TTFT P99 over the SLO (B.6/B.7) --------------------------------------------------
        if th.ttft_p99_s is not None and slo.old is not None:
            for key, qs in slo.quantiles(N.TTFT, (0.99,)).items():
                p99 = qs.get(0.99)
                if p99 is not None and p99 > th.ttft_p99_s and self._may_fire("ttft_slo", server, key, now):
                    out.append(make_finding(
                        "ttft_slo", rank=0, step=None, when=wall,
                        summary=f"TTFT P99 {p99:.3f} s > SLO {th.ttft_p99_s:g} s over the last {_secs(slo.seconds)} on {_who(server, key)}",
                        data={**_series_data(server, key), "ttft_p99_s": p99, "slo_s": th.ttft_p99_s, "window_s": round(slo.seconds, 1),
                              "kv_cache_usage": latest.gauge(N.KV_USAGE).get(key), "waiting": latest.gauge(N.WAITING).get(key)},
                    ))

        # -- inter-token latency (the renamed TPOT) and e2e latency P99 (B.6) -----------------
        for kind, bases, limit, what in (("inter_token_latency", N.ITL, th.itl_p99_s, "inter-token latency"),
                                         ("e2e_slo", N.E2E, th.e2e_p99_s, "e2e latency")):
            if limit is None or slo.old is None:
                continue
            for key, qs in slo.quantiles(bases, (0.99,)).items():
                p99 = qs.get(0.99)
                if p99 is None:
                    continue  # no request finished in the window: nothing to judge
                if self._episode(kind, server, key, p99 > limit):
                    out.append(make_finding(
                        kind, rank=0, step=None, when=wall,
                        summary=f"{what} P99 {p99 * 1e3:.0f} ms > {limit * 1e3:g} ms over the last {_secs(slo.seconds)} on {_who(server, key)}",
                        data={**self._episode_data(kind, server, key, now), "p99_s": p99, "threshold_s": limit, "window_s": round(slo.seconds, 1),
                              "running": latest.gauge(N.RUNNING).get(key), "waiting": latest.gauge(N.WAITING).get(key),
                              "kv_cache_usage": latest.gauge(N.KV_USAGE).get(key)},
                    ))

        # -- running at max_num_seqs while requests wait (B.6) ---------------------------------
        if th.max_num_seqs is not None:
            waiting_by = latest.gauge(N.WAITING)
            for key, running in latest.gauge(N.RUNNING).items():
                waiting = waiting_by.get(key, 0.0)
                if self._episode("max_num_seqs_saturated", server, key, running >= th.max_num_seqs and waiting > 0):
                    out.append(make_finding(
                        "max_num_seqs_saturated", rank=0, step=None, when=wall,
                        summary=(f"{running:.0f} requests running = max_num_seqs {th.max_num_seqs} while {waiting:.0f} wait "
                                 f"(KV-cache usage {latest.gauge(N.KV_USAGE).get(key, float('nan')):.2f}) on {_who(server, key)}"),
                        data={**self._episode_data("max_num_seqs_saturated", server, key, now), "running": running, "waiting": waiting,
                              "max_num_seqs": th.max_num_seqs, "kv_cache_usage": latest.gauge(N.KV_USAGE).get(key)},
                    ))

        # -- prompt-token rate below half its window median while requests wait ---------------
        if latest.old is not None and latest.seconds > 0:
            waiting_by = latest.gauge(N.WAITING)
            for key, rate in latest.rate(N.PROMPT_TOKENS).items():
                if rate is None:
                    continue
                hist = self._prompt_rates.setdefault((server, key), deque(maxlen=4096))
                while hist and hist[0][0] < now - th.prefill_window_s:
                    hist.popleft()
                prior = [r for _, r in hist]
                hist.append((now, rate))
                if len(prior) < th.prefill_min_intervals:
                    continue
                med = statistics.median(prior + [rate])
                waiting = waiting_by.get(key, 0.0)
                if med <= 0:
                    continue
                if self._episode("prefill_rate_drop", server, key, waiting > 0 and rate < th.prefill_drop * med):
                    out.append(make_finding(
                        "prefill_rate_drop", rank=0, step=None, when=wall,
                        summary=(f"prompt tokens {rate:.0f}/s over the last {_secs(latest.seconds)}, < {th.prefill_drop:.0%} of "
                                 f"their median {med:.0f}/s over {_secs(now - hist[0][0])}, while {waiting:.0f} requests wait, "
                                 f"on {_who(server, key)}"),
                        data={**self._episode_data("prefill_rate_drop", server, key, now), "prompt_tokens_per_s": rate, "median_per_s": med,
                              "threshold_share": th.prefill_drop, "waiting": waiting, "intervals": len(hist),
                              "preemptions_total": preempt_total.get(key)},
                    ))

        # -- spec-decode acceptance (B.6; the gauge is gone, Δaccepted / Δdraft) ---------------
        if slo.old is not None:
            for key, acc in slo.ratio(N.SPEC_ACCEPTED, N.SPEC_DRAFT, th.spec_min_draft_tokens).items():
                if acc is not None and acc < th.spec_acceptance and self._may_fire("spec_decode_acceptance", server, key, now):
                    out.append(make_finding(
                        "spec_decode_acceptance", rank=0, step=None, when=wall,
                        summary=f"speculative decoding accepts {acc:.2f} of draft tokens (< {th.spec_acceptance}) over {_secs(slo.seconds)} on {_who(server, key)}",
                        data={**_series_data(server, key), "acceptance": acc, "threshold": th.spec_acceptance, "window_s": round(slo.seconds, 1)},
                    ))

        # -- errors (B.7 error-rate query, by finished_reason; HTTP 5xx) ----------------------
        if slo.old is not None:
            finished = slo.increase(N.REQUEST_SUCCESS)
            errors = slo.increase(N.REQUEST_SUCCESS, {"finished_reason": {"error"}})
            for key, total in finished.items():
                bad = errors.get(key, 0.0)
                if total >= th.error_min_requests and bad / total > th.error_ratio and self._may_fire("serving_errors", server, key, now):
                    out.append(make_finding(
                        "serving_errors", rank=0, step=None, when=wall,
                        summary=f"{bad:.0f} of {total:.0f} finished requests ended in error ({bad / total:.1%} > {th.error_ratio:.0%}) over {_secs(slo.seconds)} on {_who(server, key)}",
                        data={**_series_data(server, key), "errors": bad, "finished": total, "ratio": bad / total,
                              "threshold": th.error_ratio, "window_s": round(slo.seconds, 1)},
                    ))
            http = http_error_ratio(slo)
            if http is not None:
                bad, total = http
                if total >= th.error_min_requests and bad / total > th.error_ratio and self._may_fire("serving_errors", server, (("source", "http"),), now):
                    out.append(make_finding(
                        "serving_errors", rank=0, step=None, when=wall,
                        summary=f"{bad:.0f} of {total:.0f} HTTP responses were 5xx ({bad / total:.1%} > {th.error_ratio:.0%}) over {_secs(slo.seconds)} on {server}",
                        data={"server": server, "source": "http", "subject": _subject(server, (("source", "http"),)), "errors": bad, "finished": total, "ratio": bad / total,
                              "threshold": th.error_ratio, "window_s": round(slo.seconds, 1)},
                    ))
        return out


def http_error_ratio(w: Window) -> tuple[float, float] | None:
    """(Δ5xx, Δall) HTTP responses in the window, or None when the server has no such counter."""
    if w.old is None or N.HTTP_REQUESTS[0] not in w.new.samples:
        return None
    total = sum(w.increase(N.HTTP_REQUESTS).values())
    bad = sum(w.increase(N.HTTP_REQUESTS, {"status": {"5xx"}}).values())
    return bad, total

"""Configuration: one dataclass, every field also settable as a ``STEPWATCH_*`` variable.

Each variable is declared once, here, next to its field (``metadata["env"]``), with its doc and
its parser. Explicit arguments to ``stepwatch.init(...)`` beat the environment. A bad value fails
at ``init`` with a message that names the variable (or argument) and what would be valid.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the variable or argument."""


# -- parsers: str (from the environment) -> value; raise ValueError with what would be valid --

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_bool(s: str) -> bool:
    v = s.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _num(x: float) -> str:
    if float(x).is_integer() and abs(x) <= 2**53:
        return f"{int(x):_}" if abs(x) >= 10_000 else str(int(x))
    return f"{x:g}"


def _int_range(lo: int, hi: int) -> Callable[[Any], int]:
    """An integer in ``lo..hi``: the upper bound keeps every value within what the code holds
    (deque sizes, int64 fields, floats in the exporters) and what makes sense."""
    want = f"an integer >= {_num(lo)} and <= {_num(hi)}"

    def parse(s: Any) -> int:
        if isinstance(s, bool):
            raise ValueError(f"expected {want}")
        try:
            v = int(s)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"expected {want}") from None
        if not isinstance(s, (int, str)) and s != v:  # 5.5 as a float, np.float32, Fraction, Decimal
            raise ValueError(f"expected {want}")
        if not lo <= v <= hi:
            raise ValueError(f"expected {want}")
        return v

    parse.__doc__ = f"integer {lo}..{hi}"
    parse.valid = f"{_num(lo)} .. {_num(hi)}"  # type: ignore[attr-defined]
    return parse


def _zero_or_at_least(lo: int, hi: int) -> Callable[[Any], int]:
    """0 (adaptive) or an integer in ``lo..hi``."""
    in_range = _int_range(lo, hi)

    def parse(s: Any) -> int:
        if not isinstance(s, bool) and (str(s).strip() == "0" or (isinstance(s, (int, float)) and s == 0)):
            return 0
        try:
            return in_range(s)
        except ValueError:
            raise ValueError(f"expected 0 (adaptive) or an integer >= {_num(lo)} and <= {_num(hi)}") from None

    parse.__doc__ = f"0 or {_num(lo)} .. {_num(hi)}"
    parse.valid = f"0 (adaptive), or {_num(lo)} .. {_num(hi)}"  # type: ignore[attr-defined]
    return parse


def _float_range(lo: float, hi: float, *, lo_open: bool = True, optional: bool = False) -> Callable[[Any], float | None]:
    """A finite number in ``(lo, hi]`` (``[lo, hi]`` when not ``lo_open``); ``optional``: empty/None is None."""
    want = f"a finite number {'>' if lo_open else '>='} {_num(lo)} and <= {_num(hi)}"

    def parse(s: Any) -> float | None:
        if optional and (s is None or (isinstance(s, str) and s.strip() == "")):
            return None
        if isinstance(s, bool):
            raise ValueError(f"expected {want}")
        try:
            v = float(s)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"expected {want}") from None
        if not math.isfinite(v) or not (v > lo if lo_open else v >= lo) or v > hi:
            raise ValueError(f"expected {want}")
        return v

    parse.valid = f"{'>' if lo_open else '>='} {_num(lo)}, <= {_num(hi)}" + (", or empty" if optional else "")  # type: ignore[attr-defined]
    return parse


_ON = ("true", "1", "yes")
_OFF = ("false", "0", "no")


def _choice(*options: str) -> Callable[[Any], str]:
    """One of ``options``; where they are ``on`` and ``off``, a bool (``console=False``) and the
    usual spellings of one (``1``/``0``, ``true``/``false``, ``yes``/``no``) say the same."""
    switch = "on" in options and "off" in options

    def parse(s: Any) -> str:
        if switch and isinstance(s, bool):
            return "on" if s else "off"
        v = str(s).strip().lower()
        if switch and v in _ON + _OFF:
            return "on" if v in _ON else "off"
        if v not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return v

    parse.valid = " / ".join(f"`{o}`" for o in options)  # type: ignore[attr-defined]
    return parse


def _no_nul(v: str) -> str:
    """``v``, refused when it holds a NUL byte: no path, file name or host name can, and
    ``dir="a\\0b"`` died of a ValueError from os.stat deep inside the session."""
    if "\0" in v:
        raise ValueError("contains a NUL byte (\\0), which no path or name can hold")
    return v


def _text(s: Any) -> str:
    """A text setting: a str, as ``dir=`` refuses what is no path (``run_id=b"job7"`` became
    ``"b'job7'"``, ``gpu_device=True`` ``"True"``: their ``str()`` was taken)."""
    if not isinstance(s, str):
        raise ValueError(f"expected text (a str), got {type(s).__name__}")
    return _no_nul(s)


def _opt_str(s: Any) -> str | None:
    if s is None:
        return None
    v = _text(s)
    return v if v.strip() else None


def _gpu_device(s: Any) -> str | None:
    """Text, or an NVML index given as a whole number (``gpu_device=0``)."""
    if isinstance(s, int) and not isinstance(s, bool):
        if s < 0:
            raise ValueError(f"an NVML index is 0 or more, got {s}")
        return str(s)
    return _opt_str(s)


def _prometheus_host(s: Any) -> str:
    """Text; None or blank: the loopback address."""
    return "127.0.0.1" if s is None else _text(s).strip() or "127.0.0.1"


def _opt_path(s: Any) -> str | None:
    """A path: text, bytes or a path object (``dir=b"/abs"`` ran into a folder named ``b'/abs'``,
    ``dir=True`` into ``./True``); empty: the default."""
    if s is None:
        return None
    if not isinstance(s, (str, bytes, os.PathLike)):
        raise ValueError(f"expected a path (text, bytes or a path object), got {type(s).__name__}")
    v = _no_nul(os.fsdecode(os.fspath(s)))
    return v if v.strip() else None


_opt_path.valid = "a path (empty: the default)"  # type: ignore[attr-defined]


_port = _int_range(1, 65535)
# A step number: STEPWATCH_STEP_OFFSET and stepwatch.set_step (int64 fields, floats in the exporters).
step_number = _int_range(0, 2**53)


def _opt_port(s: Any) -> int | None:
    """Optional TCP port: empty/None = off; otherwise parsed as every integer setting is."""
    if s is None or (isinstance(s, str) and s.strip() == ""):
        return None
    try:
        return _port(s)
    except ValueError:
        raise ValueError("expected a TCP port 1-65535 (or empty for off)") from None


def _bool_value(s: Any) -> bool:
    """A bool, the int 1 or 0 (the Valid column's spelling), or a string as in the environment."""
    if isinstance(s, bool):
        return s
    if type(s) is int and s in (0, 1):
        return bool(s)
    if isinstance(s, str):
        return _parse_bool(s)
    raise ValueError("expected True or False, 1 or 0")


_bool_value.valid = "`1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`"  # type: ignore[attr-defined]
_opt_port.valid = "1 .. 65535, or empty (off)"  # type: ignore[attr-defined]


def _flops_value(v: Any) -> Any:
    if v is None or callable(v):
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError("expected None, a number of FLOPs >= 0, or a callable(batch)")
    return v


def _tensorboard_target(v: Any) -> Any:
    """A log directory (str or path; empty = off) or a writer object with ``add_scalar``."""
    if v is None:
        return None
    if isinstance(v, (str, os.PathLike)):
        d = _no_nul(os.fsdecode(os.fspath(v)))  # os.path.exists says False for a NUL, not why
        if not d.strip():
            return None
        if os.path.exists(d) and not os.path.isdir(d):
            raise ValueError(f"{d} is a file, not a directory: give a directory for the event files "
                             "(one rank<R> folder each), or empty for off")
        return os.path.abspath(d)
    if callable(getattr(v, "add_scalar", None)) and callable(getattr(v, "add_text", None)):
        return v
    raise ValueError("expected a directory path or a SummaryWriter (an object with add_scalar and add_text)")


def _exporters(v: Any) -> tuple[Any, ...]:
    """Exporter instances: a ``stepwatch.Exporter``, or any object with ``export``,
    ``force_flush`` and ``shutdown`` methods. One such object alone is taken as a list of one. A class, a function or a string would fail only at the first export,
    on the background thread: refused here, by position."""
    if v is None:
        return ()
    if _is_exporter(v):
        return (v,)
    if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
        raise ValueError("expected a list of exporter instances (stepwatch.Exporter subclasses)")
    out = tuple(v)
    for i, e in enumerate(out):
        if _is_exporter(e):
            continue
        if isinstance(e, type) and _is_exporter_class(e):
            raise ValueError(f"item {i} is the class {e.__name__}, not an instance: did you mean {e.__name__}()?")
        raise ValueError(f"item {i} ({e!r:.60}) is not an exporter: expected an instance of a stepwatch.Exporter "
                         "subclass (an object with export(batch), force_flush(timeout_s) and shutdown())")
    return out


def _is_exporter(e: Any) -> bool:
    return not isinstance(e, type) and _is_exporter_class(e)


def _is_exporter_class(c: Any) -> bool:
    return all(callable(getattr(c, m, None)) for m in ("export", "force_flush", "shutdown"))


def _opt(env: str | None, doc: str, parse: Callable[[Any], Any]) -> dict[str, Any]:
    return {"env": env, "doc": doc, "parse": parse}


@dataclass(frozen=True, kw_only=True)
class Config:
    """stepwatch's settings. Field docs are the README's variable table."""

    enabled: bool = field(
        default=True,
        metadata=_opt("STEPWATCH_ENABLED", "Master switch. `0` makes every stepwatch call a no-op, and a bad value "
                      "of another setting one warning line, not an error: the switch gets a job past it.", _bool_value),
    )
    dir: str | None = field(
        default=None,
        metadata=_opt(
            "STEPWATCH_DIR",
            "Run directory. Default `./stepwatch-runs/<run id>/` (see 'Run directory').",
            _opt_path,
        ),
    )
    run_id: str | None = field(
        default=None,
        metadata=_opt(
            "STEPWATCH_RUN_ID",
            "Run id used in the default run directory. Default: torchrun's `TORCHELASTIC_RUN_ID`, "
            "else derived from `MASTER_ADDR`/`MASTER_PORT`, else from the default store's address when "
            "the process group exists as the session starts (`mp.spawn` ranks with "
            "`init_method=\"tcp://...\"`), else a timestamp and pid (in a job of several ranks: one "
            "warning, each rank then writes its own run directory: set this to the same value on every rank).",
            _opt_str,
        ),
    )
    step_offset: int = field(
        default=0,
        metadata=_opt("STEPWATCH_STEP_OFFSET", "Number of the first step (set it when a job resumes).", step_number),
    )
    step_boundary: str = field(
        default="auto",
        metadata=_opt(
            "STEPWATCH_STEP_BOUNDARY",
            "What ends a step. `auto`: the last optimizer step of an iteration (each backward in a loop "
            "without a torch optimizer); the first `stepwatch.step()` call switches to `explicit`. "
            "`explicit`: only `stepwatch.step()`, from the first step on (a GAN, whose two optimizers "
            "step in turn, each after its own forward: one step an iteration).",
            _choice("auto", "explicit"),
        ),
    )
    records: bool = field(
        default=True,
        metadata=_opt(
            "STEPWATCH_RECORDS",
            "Write `steps.rank<R>.jsonl` and `findings.rank<R>.jsonl`. `0`: no run directory is written at "
            "all, no `run.json` and no `rank<R>.json` either, so `stepwatch report`, `stepwatch capture "
            "RUN_DIR` and `stepwatch dump RUN_DIR` have nothing to read (`stepwatch dump PID` still works); "
            "an OOM's `oom-<n>/` or a capture, when one happens, is still written there.",
            _bool_value,
        ),
    )
    disk_budget_mb: int = field(
        default=1024,
        metadata=_opt(
            "STEPWATCH_DISK_BUDGET_MB",
            "Disk budget for one launch's files in the run directory (all ranks; a relaunch's files come beside the earlier ones); each rank's records rotate within its share.",
            _int_range(1, 10**7),
        ),
    )
    console: str = field(
        default="auto",
        metadata=_opt(
            "STEPWATCH_CONSOLE",
            "Live console on the console rank: `auto` (a refreshing line on a terminal, one line a "
            "minute otherwise), `on` (every interval, even when not a terminal), `off`.",
            _choice("auto", "on", "off"),
        ),
    )
    console_rank: int = field(
        default=0,
        metadata=_opt("STEPWATCH_CONSOLE_RANK", "Which rank prints the live console.", _int_range(0, 2**31 - 1)),
    )
    console_interval_s: float = field(
        default=5.0,
        metadata=_opt("STEPWATCH_CONSOLE_INTERVAL", "Seconds between console updates on a terminal.", _float_range(0.1, 86400.0, lo_open=False)),
    )
    nvtx: bool = field(
        default=True,
        metadata=_opt(
            "STEPWATCH_NVTX",
            "Open NVTX ranges `step_N`, `forward`, `backward`, `optimizer` and user phases when an "
            "NVTX tool can listen (nsys sets `NVTX_INJECTION64_PATH` in the job it launches, or a "
            "tool library is already loaded); with none, stepwatch makes no NVTX call.",
            _bool_value,
        ),
    )
    window: int = field(
        default=50,
        metadata=_opt("STEPWATCH_WINDOW", "Steps per analysis window (percentiles, detectors).", _int_range(2, 100_000)),
    )
    finding_repeat_windows: int = field(
        default=20,
        metadata=_opt(
            "STEPWATCH_FINDING_REPEAT_WINDOWS",
            "Every finding kind is rate-limited: a condition that persists is one finding per episode, "
            "repeated with its count at most every N windows (`STEPWATCH_WINDOW` steps each); an episode "
            "ends after a window without it, with one closing finding giving the total.",
            _int_range(1, 100_000),
        ),
    )
    data_wait_threshold_ms: float = field(
        default=10.0,
        metadata=_opt(
            "STEPWATCH_DATA_WAIT_MS",
            "Mean data wait per step over a window above which a `data_loading` finding is raised "
            "(reference B.9: 10 ms).",
            _float_range(0.0, 3_600_000.0),
        ),
    )
    device_timing: bool = field(
        default=True,
        metadata=_opt(
            "STEPWATCH_DEVICE_TIMING",
            "On a GPU, time forward/backward/optimizer with device events (native `cuda_ext` ring, "
            "else `torch.cuda.Event`), read off the training thread; `clock` becomes `device`.",
            _bool_value,
        ),
    )
    lightning_callback: bool = field(
        default=True,
        metadata=_opt(
            "STEPWATCH_LIGHTNING_CALLBACK",
            "Add stepwatch's Lightning callback to every `lightning.pytorch.Trainer` and "
            "`pytorch_lightning.Trainer` built while a session runs (Lightning's `callbacks_factory` "
            "entry points), so forward time, FLOPs, "
            "tokens, loss and lr need no code change. `0`: only the callbacks you pass yourself.",
            _bool_value,
        ),
    )
    queue_size: int = field(
        default=4096,
        metadata=_opt(
            "STEPWATCH_QUEUE_SIZE",
            "Bound of the training-thread -> background-thread queue; when full, records are dropped and counted.",
            _int_range(16, 1_048_576),
        ),
    )
    flush_interval_s: float = field(
        default=0.25,
        metadata=_opt(
            "STEPWATCH_FLUSH_INTERVAL",
            "Seconds between background passes (records written and flushed each pass).",
            _float_range(0.01, 60.0, lo_open=False),
        ),
    )
    prometheus_port: int | None = field(
        default=None,
        metadata=_opt(
            "STEPWATCH_PROMETHEUS_PORT",
            "Base port of the per-rank Prometheus endpoint (text format 0.0.4 on /metrics); the rank with "
            "local rank L serves base + L. Unset: no endpoint. A taken port is a warning, not an error.",
            _opt_port,
        ),
    )
    prometheus_host: str = field(
        default="127.0.0.1",
        metadata=_opt(
            "STEPWATCH_PROMETHEUS_HOST",
            "Address the Prometheus endpoint binds to (`0.0.0.0` to be scraped from other hosts).",
            _prometheus_host,
        ),
    )
    otel: bool = field(
        default=True,
        metadata=_opt(
            "STEPWATCH_OTEL",
            "OTLP metrics export when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `_METRICS_ENDPOINT`) is set; "
            "`0` keeps OTLP off even then. Protocol, headers, timeout: the standard `OTEL_EXPORTER_OTLP_*` variables.",
            _bool_value,
        ),
    )
    tensorboard: Any = field(
        default=None,
        metadata=_opt(
            "STEPWATCH_TENSORBOARD",
            "TensorBoard event files under `<dir>/rank<R>/` (one run per rank): `stepwatch/<field>` "
            "scalars at the optimizer step, findings as text. As an argument also a `SummaryWriter` "
            "to write into (docs/sinks.md). Unset: off.",
            lambda v: _tensorboard_target(v),
        ),
    )
    wandb: bool = field(
        default=True,
        metadata=_opt(
            "STEPWATCH_WANDB",
            "Log into the process's active W&B run (`wandb.run`), when there is one: "
            "`stepwatch/<field>` against `stepwatch/step`, findings as a table (docs/sinks.md). "
            "`0`: never.",
            _bool_value,
        ),
    )
    mlflow: bool = field(
        default=True,
        metadata=_opt(
            "STEPWATCH_MLFLOW",
            "Log into the MLflow run active on the training thread, when there is one: "
            "`stepwatch/<field>` metrics at the optimizer step, findings as tags and a text "
            "artifact (docs/sinks.md). `0`: never.",
            _bool_value,
        ),
    )
    gpu_telemetry: bool = field(
        default=True,
        metadata=_opt(
            "STEPWATCH_GPU_TELEMETRY",
            "GPU health sampler (NVML + GPM on NVIDIA, amdsmi on AMD) on a side thread, under the DCGM "
            "exporter's field names. Without a GPU or driver it logs one line and stays off.",
            _bool_value,
        ),
    )
    gpu_sample_hz: float = field(
        default=1.0,
        metadata=_opt(
            "STEPWATCH_GPU_SAMPLE_HZ",
            "GPU samples per second, at most 10 (NVML GPM needs two samples at least 100 ms apart).",
            _float_range(0.01, 10.0, lo_open=False),
        ),
    )
    gpu_device: str | None = field(
        default=None,
        metadata=_opt(
            "STEPWATCH_GPU_DEVICE",
            "Which GPU this rank samples: a `GPU-...` UUID, a PCI bus id or an NVML index. Default: "
            "the rank's device, matched by UUID (see docs/telemetry.md).",
            _gpu_device,
        ),
    )
    peak_tflops: float | None = field(
        default=None,
        metadata=_opt(
            "STEPWATCH_PEAK_TFLOPS",
            "Dense peak TFLOP/s of this rank's device, used for every dtype in MFU; overrides the "
            "built-in table (docs/mfu.md). Needed for an MFU on CPU or on a device the table lacks.",
            _float_range(0.0, 1e6, optional=True),
        ),
    )
    training_metrics: bool = field(
        default=True,
        metadata=_opt(
            "STEPWATCH_TRAINING_METRICS",
            "FLOPs, MFU/HFU, tokens and grad-norm (docs/mfu.md). On CPU the grad norm is real compute "
            "on the training thread (see benchmarks/flops_gradnorm.py); `0` leaves those fields null.",
            _bool_value,
        ),
    )
    grad_norm_every: int = field(
        default=1,
        metadata=_opt(
            "STEPWATCH_GRAD_NORM_EVERY",
            "Compute the grad norm every N optimizer steps (1 = every step). Steps GradScaler skips "
            "are always probed.",
            _int_range(1, 1_000_000),
        ),
    )
    grad_norm_spike_abs: float = field(
        default=10.0,
        metadata=_opt(
            "STEPWATCH_GRAD_NORM_SPIKE_ABS",
            "A grad norm above this raises `grad_norm_spike` (reference B.7: `train_grad_norm > 10`).",
            _float_range(0.0, 1e38),
        ),
    )
    grad_norm_spike_factor: float = field(
        default=5.0,
        metadata=_opt(
            "STEPWATCH_GRAD_NORM_SPIKE_FACTOR",
            "A grad norm above this many times the rolling median of the last "
            "`STEPWATCH_GRAD_NORM_WINDOW` steps of the same optimizer raises `grad_norm_spike` "
            "(a second model's optimizer keeps a median of its own).",
            _float_range(1.0, 1e6),
        ),
    )
    grad_norm_window: int = field(
        default=100,
        metadata=_opt(
            "STEPWATCH_GRAD_NORM_WINDOW",
            "Steps in the rolling median that grad-norm spikes are measured against.",
            _int_range(2, 100_000),
        ),
    )
    mfu_drop_points: float = field(
        default=5.0,
        metadata=_opt(
            "STEPWATCH_MFU_DROP_POINTS",
            "MFU percentage points below its value `STEPWATCH_MFU_DROP_WINDOW_S` earlier that raise "
            "`mfu_drop` (reference B.7: 5 points in 10 minutes).",
            _float_range(0.0, 100.0),
        ),
    )
    mfu_drop_window_s: float = field(
        default=600.0,
        metadata=_opt(
            "STEPWATCH_MFU_DROP_WINDOW_S",
            "Seconds back that the current MFU is compared with for `mfu_drop` (reference B.7: 10 min).",
            _float_range(1.0, 604_800.0, lo_open=False),
        ),
    )
    low_mfu: float = field(
        default=0.4,
        metadata=_opt(
            "STEPWATCH_LOW_MFU",
            "Window-median MFU (0-1) below which `low_mfu` is raised, judged over at least 100 steps "
            "where MFU is known (reference B.10: 'Low MFU in training (< 40%)').",
            _float_range(0.0, 1.0),
        ),
    )
    comm: bool = field(
        default=True,
        metadata=_opt(
            "STEPWATCH_COMM",
            "Communication timing: DDP AllReduce buckets through the comm hook, FSDP2 all-gather / "
            "reduce-scatter, overlap with backward, bus bandwidth, and the cross-rank straggler exchange "
            "(docs/comm.md).",
            _bool_value,
        ),
    )
    overlap_threshold: float = field(
        default=0.8,
        metadata=_opt(
            "STEPWATCH_OVERLAP_THRESHOLD",
            "Mean AllReduce/backward overlap over a window below which `allreduce_not_overlapped` is "
            "raised (reference B.2: target > 80%).",
            _float_range(0.0, 1.0),
        ),
    )
    straggler_every: int = field(
        default=0,
        metadata=_opt(
            "STEPWATCH_STRAGGLER_EVERY",
            "Steps per straggler-exchange window: every N steps each rank publishes one compact summary "
            "(compute without comm waiting, step time, data wait) through the c10d store. `0`: adaptive "
            "(from the warm-up's step time: a persistent straggler is named after at least 1 s, within "
            "20 steps of a warm-up of at most 20, and within 60 s; docs/comm.md).",
            _zero_or_at_least(2, 100_000),
        ),
    )
    straggler_margin: float = field(
        default=0.2,
        metadata=_opt(
            "STEPWATCH_STRAGGLER_MARGIN",
            "A rank is slow in a window when its compute time exceeds the median of the other ranks' by "
            "this fraction.",
            _float_range(0.0, 100.0),
        ),
    )
    straggler_windows: int = field(
        default=3,
        metadata=_opt(
            "STEPWATCH_STRAGGLER_WINDOWS",
            "Consecutive slow windows before a `straggler` finding names the rank (adaptive windows "
            "may use fewer when steps are long, to name it within 60 s).",
            _int_range(1, 10_000),
        ),
    )
    # -- hang watchdog and captures (capture/, docs/hang.md) --
    watchdog: str = field(
        default="auto",
        metadata=_opt(
            "STEPWATCH_WATCHDOG",
            "Hang watchdog sidecar and `kill -USR1` stack dumps: `auto` (on in a multi-rank job and "
            "under `stepwatch run`), `on`, `off`.",
            _choice("auto", "on", "off"),
        ),
    )
    hang_timeout: float | None = field(
        default=None,
        metadata=_opt(
            "STEPWATCH_HANG_TIMEOUT",
            "Seconds without progress (a step end, a phase change, a collective) that make a hang. "
            "Default: adaptive, 10 x the p99 step time, at least 30 s, at most 300 s (below the "
            "NCCL/gloo process-group timeouts of 10/30 min); x5 inside a checkpoint save. At least 1 s: "
            "the sidecar looks 4 times a second, and a shorter timeout calls every pause a hang.",
            _float_range(1.0, 86400.0, lo_open=False, optional=True),
        ),
    )
    hang_action: str = field(
        default="dump",
        metadata=_opt(
            "STEPWATCH_HANG_ACTION",
            "On a hang: `dump` (stacks and report once, keep waiting) or `exit` (then end the rank "
            "so torchrun can restart the job).",
            _choice("dump", "exit"),
        ),
    )
    capture: str = field(
        default="auto",
        metadata=_opt(
            "STEPWATCH_CAPTURE",
            "Anomaly-triggered torch.profiler captures (step-time spike, data-loading stall, MFU "
            "drop, grad-norm spike): `auto` (on in a multi-rank job and under `stepwatch run`), `on`, `off`.",
            _choice("auto", "on", "off"),
        ),
    )
    capture_steps: int = field(
        default=3,
        metadata=_opt("STEPWATCH_CAPTURE_STEPS", "Steps per capture.", _int_range(1, 1000)),
    )
    capture_cooldown_s: float = field(
        default=600.0,
        metadata=_opt(
            "STEPWATCH_CAPTURE_COOLDOWN",
            "Seconds after a capture before another may be triggered.",
            _float_range(0.0, 604_800.0),
        ),
    )
    capture_max: int = field(
        default=5,
        metadata=_opt("STEPWATCH_CAPTURE_MAX", "Most captures per run and rank.", _int_range(0, 10_000)),
    )
    capture_budget_mb: int = field(
        default=512,
        metadata=_opt(
            "STEPWATCH_CAPTURE_BUDGET_MB",
            "Disk budget of `<run dir>/captures/` (all ranks); no capture starts that would go "
            "beyond it, the next one counted at the size of the largest so far.",
            _int_range(1, 10**7),
        ),
    )
    spike_mads: float = field(
        default=6.0,
        metadata=_opt(
            "STEPWATCH_SPIKE_MADS",
            "A step slower than the rolling median plus this many MAD-sigmas (and at least 2x the "
            "median and 2 ms over it) is a `step_time_spike`.",
            _float_range(0.0, 1000.0),
        ),
    )
    memory: bool = field(
        default=True,
        metadata=_opt(
            "STEPWATCH_MEMORY",
            "Memory fields (CUDA allocated/reserved/peak/fragmentation/retries, host RSS, DataLoader "
            "workers' USS/PSS), the `memory_*` findings and OOM forensics (`oom-<n>/`); see docs/memory.md.",
            _bool_value,
        ),
    )
    memory_every: int = field(
        default=10,
        metadata=_opt(
            "STEPWATCH_MEMORY_EVERY",
            "Read memory at every Nth step end (1 = every step); records in between have null memory "
            "fields, and the CUDA peak is the peak since the previous read.",
            _int_range(1, 1_000_000),
        ),
    )
    memory_peak_reset: bool = field(
        default=True,
        metadata=_opt(
            "STEPWATCH_MEMORY_PEAK_RESET",
            "Reset the CUDA allocator's peak after each read (`torch.cuda.reset_peak_memory_stats`), so "
            "`mem_peak_bytes` is the peak since the previous read; your own `max_memory_allocated()` then "
            "reads the same. `0`: never reset (the peak is the run's high-water mark).",
            _bool_value,
        ),
    )
    memory_growth_window: int = field(
        default=200,
        metadata=_opt(
            "STEPWATCH_MEMORY_GROWTH_WINDOW",
            "Steps over which steady memory growth is judged (`memory_growth`); at least 8 reads "
            "(8 x STEPWATCH_MEMORY_EVERY steps) whatever it is set to.",
            _int_range(20, 100_000),
        ),
    )
    memory_growth_mib: float = field(
        default=16.0,
        metadata=_opt(
            "STEPWATCH_MEMORY_GROWTH_MIB",
            "Least rise (MiB) over the growth window that can make a `memory_growth` finding.",
            _float_range(0.0, 1_048_576.0),
        ),
    )
    memory_history: str = field(
        default="auto",
        metadata=_opt(
            "STEPWATCH_MEMORY_HISTORY",
            "CUDA allocation history (`torch.cuda.memory._record_memory_history`, bounded) for the "
            "snapshot in `oom-<n>/`: `auto` (switched on once a `memory_growth` or `memory_near_limit` "
            "finding fires), `on` (from the first steps once CUDA is in use), `off`; switched on and off "
            "on the training thread (torch keeps its callbacks per thread).",
            _choice("auto", "on", "off"),
        ),
    )
    memory_history_entries: int = field(
        default=20000,
        metadata=_opt(
            "STEPWATCH_MEMORY_HISTORY_ENTRIES",
            "Most alloc/free events the CUDA allocation history keeps (each costs a few KB of host memory).",
            _int_range(1, 10_000_000),
        ),
    )
    flops: Any = field(
        default=None,
        metadata=_opt(
            None,
            "FLOPs override (argument only): a number of FLOPs per micro-batch, or a callable of the "
            "batch; None counts them automatically (see docs/mfu.md).",
            lambda v: _flops_value(v),
        ),
    )
    exporters: tuple[Any, ...] = field(
        default=(),
        metadata=_opt(None, "Extra exporters (objects with `export`, `force_flush`, `shutdown`); argument only.",
                      _exporters),
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Build a config: environment first, explicit keyword arguments on top."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        names = {f.name: f for f in dataclasses.fields(cls)}
        _say_unknown(env, {f.metadata["env"] for f in names.values() if f.metadata.get("env")})
        off = _switched_off(names["enabled"], env, overrides)

        def bad(msg: str) -> None:
            # The master switch off is how a user gets a job past a stepwatch setting that stops it:
            # then a bad value is one line, not an error (the switch itself must be readable).
            if not off:
                raise ConfigError(msg)
            from ._log import warn_once

            warn_once(f"config.off.{msg}", "stepwatch: %s; ignored: stepwatch is off (STEPWATCH_ENABLED=0)", msg)

        for f in names.values():
            var = f.metadata.get("env")
            if var and var in env:
                raw = env[var]
                try:
                    values[f.name] = f.metadata["parse"](raw)
                except ValueError as e:
                    bad(f"{var}={raw!r} is not valid: {e}")
        for key, raw in overrides.items():
            f = names.get(key)
            if f is None:
                valid = ", ".join(sorted(names))
                raise ConfigError(f"stepwatch.init() got an unknown argument {key!r}; valid arguments: {valid}")
            try:
                values[key] = f.metadata["parse"](raw)
            except (TypeError, ValueError) as e:
                bad(f"stepwatch.init({key}={raw!r}) is not valid: {e}")
        return cls(**values)

    def as_manifest(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "exporters":
                v = [getattr(e, "name", type(e).__name__) for e in v]
            elif f.name == "tensorboard" and v is not None and not isinstance(v, str):
                v = type(v).__name__  # the user's writer object
            out[f.name] = v
        return out


def _switched_off(f: Any, env: Mapping[str, str], overrides: Mapping[str, Any]) -> bool:
    """``enabled`` is False (the argument over the variable); an unreadable switch is not off (its
    own error comes with the other settings')."""
    try:
        if "enabled" in overrides:
            return f.metadata["parse"](overrides["enabled"]) is False
        var = f.metadata["env"]
        return var in env and f.metadata["parse"](env[var]) is False
    except (TypeError, ValueError):
        return False


def _say_unknown(env: Mapping[str, str], known: set[str]) -> None:
    """One line for each ``STEPWATCH_*`` variable that is no setting (a misspelled name would
    otherwise be ignored without a word), with the closest setting's name."""
    unknown = [v for v in env if v.startswith("STEPWATCH_") and v not in known]
    if not unknown:
        return
    import difflib

    from . import _env
    from ._log import warn_once

    internal = {v for k, v in vars(_env).items() if k.isupper() and isinstance(v, str)}
    for var in sorted(set(unknown) - internal):
        # The settings are upper case, and difflib compares case-sensitively: STEPWATCH_enabled
        # was closest to STEPWATCH_DIR (its lowercase letters matched nothing).
        close = difflib.get_close_matches(var.upper(), sorted(known), n=1)
        warn_once(
            f"config.unknown.{var}",
            "stepwatch: %s is not a stepwatch setting, and is ignored%s (the settings: the README's "
            "Configuration section)", var, f"; did you mean {close[0]}?" if close else "",
        )


def valid_values(var: str) -> str:
    """What ``var`` accepts (the README's "Valid" column); every number is bounded."""
    for f in dataclasses.fields(Config):
        if f.metadata.get("env") == var:
            return getattr(f.metadata["parse"], "valid", "any text (empty: default)")
    raise KeyError(var)


def env_table() -> list[tuple[str, str, str]]:
    """(variable, default, doc) for every ``STEPWATCH_*`` variable, in declaration order."""
    rows = []
    for f in dataclasses.fields(Config):
        var = f.metadata.get("env")
        if var:
            rows.append((var, repr(f.default), f.metadata["doc"]))
    return rows

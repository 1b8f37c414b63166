"""The node checks behind ``stepwatch doctor``. Each returns :class:`Check` objects and never raises
for what it finds on the machine (a missing driver is a finding, not an error)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

STATUSES = ("ok", "info", "warn", "fail")


@dataclass
class Check:
    name: str
    status: str
    summary: str
    action: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- GPUs --------------------------------------------------------------------------------------

def _nvidia_device_nodes() -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit())
    except OSError:
        return []


def check_nvidia(nvml: Any = None) -> list[Check]:
    """Driver, each GPU's health, GPM support. ``nvml``: the pynvml module (a stand-in in tests)."""
    from ..telemetry.source import driver_problem, load_nvml

    if nvml is None:
        nvml, why = load_nvml()
        if nvml is None:
            return [Check("nvidia driver", "warn", why or "pynvml unavailable", "pip install nvidia-ml-py")]
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        nodes = _nvidia_device_nodes()
        problem = driver_problem(nvml, e)
        if nodes:  # device nodes exist, NVML does not answer: a broken install, not a CPU machine
            return [Check("nvidia driver", "fail", f"{problem}, although /dev has {', '.join(nodes)}",
                          "Reinstall or reload the NVIDIA driver (nvidia-smi must work); in a container, "
                          "run it with the NVIDIA container toolkit (--gpus all).")]
        return [Check("nvidia driver", "info",
                      f"No NVIDIA GPU here: {problem}. GPU checks skipped; stepwatch runs on CPU.",
                      None, {"error": str(e)})]
    try:
        return _nvidia_checks(nvml)
    finally:
        nvml.nvmlShutdown()


def _nvidia_checks(nvml: Any) -> list[Check]:
    from ..telemetry.gpm import gpm_supported
    from ..telemetry.nvml import NvmlDevice, text
    from ..telemetry.throttle import BY_NAME, THERMAL_BITS

    out = []
    try:
        driver = text(nvml.nvmlSystemGetDriverVersion())
    except nvml.NVMLError:
        driver = "unknown"
    try:
        cuda = nvml.nvmlSystemGetCudaDriverVersion_v2()
        cuda_s = f"{cuda // 1000}.{cuda % 1000 // 10}"
    except nvml.NVMLError:
        cuda_s = "unknown"
    n = nvml.nvmlDeviceGetCount()
    out.append(Check("nvidia driver", "ok" if n else "warn",
                     f"driver {driver}, CUDA driver API {cuda_s}, {n} GPU(s)",
                     None if n else "The driver sees no GPU: check `nvidia-smi` and the container's --gpus.",
                     {"driver": driver, "cuda": cuda_s, "gpus": n}))
    for i in range(n):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        dev = NvmlDevice(nvml, h, gpm=False)
        s = dev.sample()
        gpm = gpm_supported(nvml, h)
        status, problems, actions = "ok", [], []
        dbe = s.get("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")
        if dbe:
            status = "fail"
            problems.append(f"{dbe} uncorrectable ECC error(s)")
            actions.append("Drain the node; the GPU needs service.")
        try:
            _, _, pending, failure = nvml.nvmlDeviceGetRemappedRows(h)
            if failure:
                status = "fail"
                problems.append("row remapping failed")
                actions.append("The GPU needs replacement (row remapping failure).")
            elif pending:
                status = "warn" if status == "ok" else status
                problems.append("row remapping pending")
                actions.append("Reset the GPU (or reboot) to apply pending row remapping.")
        except (nvml.NVMLError, AttributeError, TypeError, ValueError):
            pass
        temp = s.get("DCGM_FI_DEV_GPU_TEMP")
        mask = s.get("DCGM_FI_DEV_CLOCKS_EVENT_REASONS") or 0
        reasons = [r for r in s.get("clocks_event_reasons", []) if r != "GpuIdle"]
        if mask & THERMAL_BITS or (temp is not None and temp > 83):
            status = "warn" if status == "ok" else status
            problems.append(f"hot ({temp} C)" + (f", {', '.join(reasons)}" if reasons else ""))
            actions.append(BY_NAME["SwThermalSlowdown"].action)
        elif reasons:
            problems.append(f"clocks held by {', '.join(reasons)}")
        parts = [s.get("name") or "GPU", f"{temp} C" if temp is not None else "temp unknown"]
        if "DCGM_FI_DEV_POWER_USAGE" in s:
            parts.append(f"{s['DCGM_FI_DEV_POWER_USAGE']:.0f} W")
        parts.append("GPM yes" if gpm else "GPM no (profiling fields need Hopper or newer)")
        summary = ", ".join(parts) + ("; " + "; ".join(problems) if problems else "; healthy")
        details = {k: v for k, v in s.items() if k != "time"}
        details["gpm"] = gpm
        out.append(Check(f"gpu {i}", status, summary, " ".join(actions) or None, details))
    return out


def check_amd() -> list[Check]:
    from ..telemetry.amd import load_amdsmi

    smi, why = load_amdsmi()
    if smi is None:
        return [Check("amd gpus", "info", f"No AMD SMI: {why}", None)]
    try:
        smi.amdsmi_init()
        handles = smi.amdsmi_get_processor_handles()
    except Exception as e:  # amdsmi's exception family has no base importable without amdsmi
        return [Check("amd gpus", "info", f"amdsmi present but not usable: {type(e).__name__}: {e}", None)]
    try:
        return [Check("amd gpus", "ok" if handles else "info", f"{len(handles)} AMD GPU(s) via amdsmi", None,
                      {"gpus": len(handles)})]
    finally:
        try:
            smi.amdsmi_shut_down()
        except Exception:  # shutting down a library we only probed; nothing to report
            pass


# -- timing backend, py-spy, nsys ---------------------------------------------------------------

def check_timing() -> Check:
    try:
        from .. import cuda_ext
    except ImportError:
        return Check("timing backend", "info", "python (stepwatch.cuda_ext not present)", None,
                     {"host": "python", "device": "python"})
    try:
        host = cuda_ext.backend_name(None)
        device, why = cuda_ext.backend_status("cuda")
    except (AttributeError, RuntimeError, ImportError, OSError) as e:
        return Check("timing backend", "info", f"python (cuda_ext could not say: {e})", None,
                     {"host": "python", "device": "python"})
    native = host.startswith("native")
    return Check("timing backend", "ok" if native else "info",
                 f"host: {host}; device: {device}" + (f" ({why})" if why else ""),
                 None if native else "Build the native extension for lower overhead (see docs/timing.md).",
                 {"host": host, "device": device, "device_unavailable_because": why})


# The optional C builds that only make stepwatch cheaper (the same records without them).
SPEEDUPS = (("step tracker", "stepwatch.hooks._ctracker"), ("FLOPs/tokens", "stepwatch.metrics._cmetrics"),
            ("records line", "stepwatch._speedups"))


def check_speedups() -> Check:
    """Whether the C accelerators import here: without them a job runs the Python code for the
    step tracker, the FLOPs/tokens collector's per-forward path, and the records line with the
    background thread's record build (the same records; more of either thread's time)."""
    import importlib

    got: dict[str, str] = {}
    for what, module in SPEEDUPS:
        try:
            importlib.import_module(module)
            got[what] = "C"
        except ImportError as e:
            got[what] = f"python ({module} not importable: {e})"
    built = all(v == "C" for v in got.values())
    return Check("C accelerators", "ok" if built else "info", "; ".join(f"{k}: {v}" for k, v in got.items()),
                 None if built else "Reinstall with a C compiler and the Python headers for the lower "
                 "always-on cost (pip install --force-reinstall --no-binary stepwatch stepwatch).",
                 {"step_tracker": got["step tracker"] == "C", "flops_tokens": got["FLOPs/tokens"] == "C",
                  "records_line": got["records line"] == "C"})


def check_pyspy(attach: bool = True) -> Check:
    from .._os import ptrace

    scope = ptrace.ptrace_scope()
    cap = ptrace.has_cap_sys_ptrace()
    exe = ptrace.find_pyspy()
    details: dict[str, Any] = {"py_spy": exe, "ptrace_scope": scope, "cap_sys_ptrace": cap}
    scope_s = ("no Yama (classic ptrace rules)" if scope is None
               else f"ptrace_scope={scope} ({ptrace.YAMA_MEANING.get(scope, 'unknown value')})")
    cap_s = {True: "CAP_SYS_PTRACE held", False: "no CAP_SYS_PTRACE", None: "capabilities unknown"}[cap]
    if exe is None:
        return Check("py-spy", "warn", f"py-spy not found; {scope_s}; {cap_s}",
                     "pip install py-spy (hang dumps and anomaly captures use it).", details)
    if not attach:
        return Check("py-spy", "info", f"{exe}; attach not tried; {scope_s}; {cap_s}", None, details)
    ok, what = ptrace.try_attach(exe)
    details["attach"] = ok
    details["attach_detail"] = what
    if ok:
        return Check("py-spy", "ok", f"attach works: {what}; {scope_s}; {cap_s}", None, details)
    return Check("py-spy", "warn", f"attach FAILED: {what}; {scope_s}; {cap_s}", ptrace.FIX, details)


def check_nsys() -> Check:
    exe = shutil.which("nsys")
    if exe is None:
        return Check("nsys", "info", "nsys (Nsight Systems) not on PATH: nsys captures are off",
                     "Install Nsight Systems to enable `nsys` captures (reference B.2).", {"nsys": None})
    try:
        res = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=15)
        version = (res.stdout or res.stderr).strip().splitlines()[0] if (res.stdout or res.stderr) else "?"
    except (OSError, subprocess.TimeoutExpired) as e:
        version = f"version unknown ({e})"
    return Check("nsys", "ok", f"{exe}: {version}", None, {"nsys": exe, "version": version})


# -- environment ---------------------------------------------------------------------------------

# Reference B.5 "Essential NCCL Environment Variables": variable -> recommended value. Rules for
# values that are wrong in production follow; corrections to the reference are marked.
NCCL_RECOMMENDED = {
    "NCCL_IB_HCA": "mlx5_0:1,...,mlx5_7:1 (pin NICs, rail-aligned)",
    "NCCL_IB_QPS_PER_CONNECTION": "4",
    "NCCL_NET_GDR_LEVEL": "SYS",
    "NCCL_NVLS_ENABLE": "1",
    "NCCL_BUFFSIZE": "8388608",
    "NCCL_MIN_NCHANNELS": "4",
    "NCCL_DEBUG": "WARN",
    "NCCL_ALGO": "unset (auto)",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
}


def check_nccl_env(env: Mapping[str, str] | None = None) -> list[Check]:
    env = os.environ if env is None else env
    present = {k: v for k, v in env.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))}
    out = []
    debug = env.get("NCCL_DEBUG", "")
    if debug.upper() in ("INFO", "TRACE"):
        out.append(Check("NCCL_DEBUG", "warn", f"NCCL_DEBUG={debug}: verbose NCCL logging costs throughput in "
                         "production (reference B.5)", "Use NCCL_DEBUG=WARN in production; INFO only to debug."))
    if "NCCL_ALGO" in env:
        out.append(Check("NCCL_ALGO", "warn", f"NCCL_ALGO={env['NCCL_ALGO']} forces the algorithm",
                         "Leave NCCL_ALGO unset (auto) unless the topology is known to be chosen badly (B.5)."))
    ifname = env.get("NCCL_SOCKET_IFNAME")
    if ifname and ",^" in ifname:
        # Correction to the reference's "^lo,^docker": NCCL applies one leading ^ to the whole list
        # (NCCL docs, NCCL_SOCKET_IFNAME), so "^docker" is read as a literal prefix.
        out.append(Check("NCCL_SOCKET_IFNAME", "warn",
                         f"NCCL_SOCKET_IFNAME={ifname}: '^' applies to the whole list; a second '^' is taken "
                         "literally, so those interfaces are not excluded",
                         "Write one leading ^: NCCL_SOCKET_IFNAME=^lo,docker"))
    if "NCCL_TIMEOUT" in env:
        # Correction: the reference recommends NCCL_TIMEOUT=1800, which NCCL's documented variables lack.
        out.append(Check("NCCL_TIMEOUT", "warn",
                         f"NCCL_TIMEOUT={env['NCCL_TIMEOUT']} is not an NCCL or PyTorch variable and has no effect",
                         "Set the collective timeout in torch.distributed.init_process_group(timeout=...) "
                         "(PyTorch's NCCL default is 10 minutes)."))
    if "NCCL_SHARP_ENABLE" in env:
        out.append(Check("NCCL_SHARP_ENABLE", "info",
                         "NCCL_SHARP_ENABLE is not among NCCL's documented variables (the reference lists it)",
                         "IB SHARP runs through the CollNet plugin: NCCL_COLLNET_ENABLE=1 with the SHARP plugin."))
    if env.get("NCCL_NVLS_ENABLE") == "0":
        out.append(Check("NCCL_NVLS_ENABLE", "info", "NVLink SHARP disabled (NCCL_NVLS_ENABLE=0)",
                         "On H100 with NVSwitch, NVLS can speed AllReduce up to 2x (reference B.5)."))
    rows = {k: {"value": present.get(k), "recommended": v} for k, v in NCCL_RECOMMENDED.items()}
    summary = (", ".join(f"{k}={v}" for k, v in sorted(present.items())) if present
               else "no NCCL_* variables set (NCCL defaults)")
    out.insert(0, Check("nccl env", "ok" if not out else "info", summary, None,
                        {"set": present, "reference": rows}))
    return out


TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def check_torchrun_env(env: Mapping[str, str] | None = None) -> list[Check]:
    env = os.environ if env is None else env
    present = {k: env[k] for k in TORCHRUN_VARS if k in env}
    out = []
    if not present:
        out.append(Check("torchrun env", "info", "not under torchrun (RANK, WORLD_SIZE unset)", None, {}))
    else:
        problems = []

        def num(k: str) -> int | None:
            try:
                return int(env[k]) if k in env else None
            except ValueError:
                problems.append(f"{k}={env[k]!r} is not an integer")
                return None

        rank, world, local, lworld = num("RANK"), num("WORLD_SIZE"), num("LOCAL_RANK"), num("LOCAL_WORLD_SIZE")
        if rank is not None and world is not None and not 0 <= rank < world:
            problems.append(f"RANK={rank} outside 0..WORLD_SIZE-1 ({world})")
        if local is not None and lworld is not None and not 0 <= local < lworld:
            problems.append(f"LOCAL_RANK={local} outside 0..LOCAL_WORLD_SIZE-1 ({lworld})")
        for k in ("MASTER_ADDR", "MASTER_PORT"):
            if world is not None and world > 1 and k not in env:
                problems.append(f"{k} unset with WORLD_SIZE={world}")
        out.append(Check("torchrun env", "warn" if problems else "ok",
                         "; ".join(problems) if problems else ", ".join(f"{k}={v}" for k, v in present.items()),
                         "Launch with torchrun (it sets these consistently)." if problems else None, present))
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        entries = [e.strip() for e in cvd.split(",") if e.strip()]
        ints = bool(entries) and all(e.isdigit() for e in entries)
        order = env.get("CUDA_DEVICE_ORDER")
        note = None
        if ints and order != "PCI_BUS_ID":
            note = ("CUDA_VISIBLE_DEVICES uses indices while CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA may number "
                    "GPUs differently from nvidia-smi on mixed nodes; set CUDA_DEVICE_ORDER=PCI_BUS_ID or use UUIDs.")
        out.append(Check("visible devices", "info", f"CUDA_VISIBLE_DEVICES={cvd}"
                         + (f", CUDA_DEVICE_ORDER={order}" if order else ""), note,
                         {"CUDA_VISIBLE_DEVICES": cvd, "CUDA_DEVICE_ORDER": order}))
    return out


def python_info() -> Check:
    return Check("python", "ok", f"{sys.version.split()[0]} at {sys.executable}", None,
                 {"version": sys.version.split()[0], "executable": sys.executable})

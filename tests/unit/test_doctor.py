"""``stepwatch doctor`` on this machine (no GPU, real py-spy, real filesystem), its environment
rules, and its GPU checks against the fake NVML of test_telemetry_nvml.py (no GPU here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pynvml
import pytest

from stepwatch._os import ptrace as pyspy
from stepwatch.doctor.checks import check_nccl_env, check_nvidia, check_speedups, check_torchrun_env
from stepwatch.doctor.storage import judge, measure

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the fake NVML lives beside this file
from test_telemetry_nvml import SCRIPT, THERMAL, FakeNvml, _tick  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def _doctor(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "STEPWATCH_"))}
    env["PYTHONPATH"] = os.path.join(ROOT, "src")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "stepwatch", "doctor", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_doctor_cli_here_exits_0_names_the_driver_and_attaches_pyspy():
    res = _doctor("--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    by = {c["name"]: c for c in report["checks"]}
    drv = by["nvidia driver"]
    if _nvml_works():
        assert drv["status"] in ("ok", "warn") and "driver" in drv["summary"]
    else:
        assert drv["status"] == "info"
        assert "NVIDIA driver not found" in drv["summary"] and "libnvidia-ml.so.1" in drv["summary"]
        assert "No NVIDIA GPU here" in drv["summary"]
    spy = by["py-spy"]
    assert isinstance(spy["details"]["attach"], bool)  # a real attach was made
    scope, cap = pyspy.ptrace_scope(), pyspy.has_cap_sys_ptrace()
    if pyspy.find_pyspy() and (cap or scope in (None, 0)):
        # The kernel allows it, so the real attach must have worked.
        assert spy["details"]["attach"] is True and spy["status"] == "ok", spy
    elif not spy["details"]["attach"]:
        assert spy["status"] == "warn" and "CAP_SYS_PTRACE" in spy["action"]
    timing = by["timing backend"]
    assert timing["details"]["host"]
    if timing["details"]["device"] == "unavailable":
        # says why, in the words of what failed (no GPU here: torch and the runtime say so)
        why = timing["details"]["device_unavailable_because"]
        assert why and "GPU" in why and why in timing["summary"]
    else:
        assert timing["details"]["device_unavailable_because"] is None
    assert report["exit_code"] == 0


def test_doctor_text_and_storage_in_process(tmp_path, monkeypatch, capsys):
    from stepwatch.cli import main

    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    assert main(["doctor", "--no-attach", "--storage", str(tmp_path), "--storage-size-mb", "8"]) == 0
    out = capsys.readouterr().out
    assert "storage" in out and "GB/s" in out
    assert "NCCL_DEBUG=INFO" in out and "costs throughput" in out
    assert list(tmp_path.iterdir()) == []  # cleaned up
    assert main(["doctor", "--storage", str(tmp_path / "missing")]) == 2
    assert "not an existing directory" in capsys.readouterr().err
    assert main(["doctor", "--storage", str(tmp_path), "--storage-jobs", "0"]) == 2
    assert "--storage-jobs" in capsys.readouterr().err
    # without --storage too: exit 2 before any check, naming the argument (they passed with 0)
    for arg, bad in (("--storage-jobs", "0"), ("--storage-size-mb", "-5"), ("--storage-seconds", "0")):
        assert main(["doctor", "--no-attach", arg, bad]) == 2, arg
        assert f"stepwatch doctor: {arg} must be" in capsys.readouterr().err


def test_storage_measure_small(tmp_path):
    r = measure(str(tmp_path), size_bytes=8 << 20, block_bytes=1 << 20, max_seconds=30)
    assert r.write_bytes == 8 << 20 and r.read_bytes == 8 << 20
    assert r.write_gbps > 0 and r.read_gbps > 0
    assert isinstance(r.direct, bool)
    assert list(tmp_path.iterdir()) == []
    d = r.to_dict()
    assert d["verdict"] == "ungraded" == judge(r.write_gbps, 1)  # one stream: not the reference's test
    r2 = measure(str(tmp_path), size_bytes=4 << 20, block_bytes=1 << 20, jobs=2)
    assert r2.write_bytes == 8 << 20 and r2.jobs == 2
    with pytest.raises(ValueError, match="block size"):
        measure(str(tmp_path), block_bytes=1000)
    with pytest.raises(ValueError, match="--storage-jobs"):
        measure(str(tmp_path), size_bytes=1 << 20, block_bytes=1 << 20, jobs=0)


def test_a_storage_test_that_wrote_nothing_grades_nothing(tmp_path):
    """``--storage-seconds 1e-6 --storage-jobs 16``: nothing was written in the time, and the
    verdict was "0.00 GB/s -> degraded" with "check the filesystem". Nothing measured is unknown."""
    r = measure(str(tmp_path), size_bytes=16 << 20, block_bytes=1 << 20, max_seconds=1e-9, jobs=16)
    if r.write_bytes:  # a stream that got its first block in: a measurement after all
        pytest.skip(f"wrote {r.write_bytes} bytes within 1 ns")
    d = r.to_dict()
    assert d["write_gbps"] is None and d["verdict"] == "unknown", d


@pytest.mark.parametrize("sig, rc", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)])
def test_doctor_storage_stopped_by_a_signal_removes_its_files(tmp_path, sig, rc):
    """The real command, signalled while its storage test writes: its files are removed, one line
    is printed (no traceback), and it exits as the signal says (SIGTERM: dies of it, 143 in a
    shell; Ctrl-C: 130)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "STEPWATCH_"))}
    env["PYTHONPATH"] = os.path.join(ROOT, "src")
    # The command as a shell starts it: SIGINT neither blocked nor ignored. Started from a
    # pytest-xdist worker, two suite runs' children ran their whole 1 GiB and then 8 GiB storage
    # test through the SIGINT and exited 0 with no line: the signal did nothing in them, ignored
    # or blocked as the worker passed it on (the parent's state then is in the message below).
    # The command itself is `python -m stepwatch`'s main.
    parent = (signal.getsignal(signal.SIGINT), sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    shell_like = ("import signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                  "signal.signal(signal.SIGINT, signal.default_int_handler); "
                  "from stepwatch.cli import main; sys.exit(main(sys.argv[1:]))")
    # 8 GiB, 20 s at most: the signal cuts it short, so little is written.
    p = subprocess.Popen([sys.executable, "-c", shell_like, "doctor", "--no-attach", "--storage", str(tmp_path),
                          "--storage-size-mb", "8192", "--storage-seconds", "20"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.iterdir()) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert p.poll() is None and list(tmp_path.iterdir()), "the storage test did not start"
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert list(tmp_path.iterdir()) == [], err
    assert p.returncode == rc, (err, parent)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "stopped by" in err and str(tmp_path) in err
    assert out == ""


def test_a_signal_right_after_a_test_file_is_made_still_removes_it(tmp_path, monkeypatch):
    """A signal that lands the moment a test file exists, before its name was kept (CI: SIGTERM
    sent as soon as the file appeared left ``.stepwatch-doctor-*`` behind). The interrupt is
    raised from ``os.open`` right after the real call made the file, where the signal handler's
    exception would surface."""
    real_open = os.open

    def open_then_interrupted(name, flags, *a, **k):
        fd = real_open(name, flags, *a, **k)
        if flags & os.O_CREAT and str(name).startswith(str(tmp_path)):
            os.close(fd)
            raise KeyboardInterrupt
        return fd

    monkeypatch.setattr(os, "open", open_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        measure(str(tmp_path), size_bytes=1 << 20, block_bytes=1 << 20, jobs=2)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_doctor_storage_jobs_are_bounded(tmp_path, capsys):
    from stepwatch.cli import main

    assert main(["doctor", "--no-attach", "--storage", str(tmp_path), "--storage-size-mb", "1",
                 "--storage-jobs", "257"]) == 2
    err = capsys.readouterr().err
    assert "--storage-jobs must be between 1 and 256, got 257" in err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="--storage-jobs must be between 1 and 256"):
        measure(str(tmp_path), size_bytes=1 << 20, block_bytes=1 << 20, jobs=257)


@pytest.mark.parametrize("args", [["--storage-jobs", "16"], ["--storage-size-mb", "64"], ["--storage-seconds", "5"],
                                  ["--storage-jobs", "1"], ["--storage-size-mb", "64", "--storage-jobs", "16"]])
def test_storage_options_without_storage_are_a_usage_error(capsys, args):
    """``doctor --storage-jobs 16`` without ``--storage`` ran no storage test, said nothing and
    exited 0: the options were ignored. Now exit 2 before any check, naming the option (its
    default value given explicitly too)."""
    from stepwatch.cli import main

    assert main(["doctor", "--no-attach", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no check ran
    assert err == (f"stepwatch doctor: {args[0]} {args[1]} applies with --storage PATH only (the storage test); "
                   "add --storage PATH, or leave it out\n"), err


def test_storage_on_a_nearly_full_filesystem_writes_nothing(tmp_path, monkeypatch, capsys):
    """Less free space than twice one block per stream: refused before any file is made (it filled
    the disk and reported [fail])."""
    import shutil

    real = shutil.disk_usage

    def nearly_full(path):
        u = real(path)
        return type(u)(u.total, u.total - (1 << 19), 1 << 19)  # 512 KiB free

    monkeypatch.setattr(shutil, "disk_usage", nearly_full)
    with pytest.raises(ValueError, match="only 0.5 MiB free; the test needs at least 2 MiB free"):
        measure(str(tmp_path), size_bytes=1 << 20, block_bytes=1 << 20)
    assert list(tmp_path.iterdir()) == []

    from stepwatch.cli import main

    assert main(["doctor", "--no-attach", "--json", "--storage", str(tmp_path), "--storage-size-mb", "1"]) == 0
    st = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["storage"]
    assert st["status"] == "warn" and "not measured, nothing written" in st["summary"], st
    assert "Free space" in st["action"]
    assert list(tmp_path.iterdir()) == []


def test_storage_verdicts_follow_the_reference():
    assert judge(12.0) == "healthy" and judge(12.0, 16) == "healthy" and judge(1.0, 15) == "ungraded"
    assert judge(10.0) == "between"
    assert judge(1.9) == "degraded"
    assert judge(None) == "unknown"


def test_speedups_check_says_which_c_parts_import(monkeypatch):
    """Built here (setup.py, a C compiler on this machine): both C. One made unimportable (as a
    broken install): that part is named as Python, with the module and the fix."""
    c = check_speedups()
    assert c.status == "ok" and c.details == {"step_tracker": True, "flops_tokens": True, "records_line": True}, c
    monkeypatch.setitem(sys.modules, "stepwatch.hooks._ctracker", None)
    c = check_speedups()
    assert c.status == "info" and c.details == {"step_tracker": False, "flops_tokens": True, "records_line": True}
    assert "step tracker: python (stepwatch.hooks._ctracker not importable" in c.summary and c.action
    monkeypatch.setitem(sys.modules, "stepwatch.metrics._cmetrics", None)
    c = check_speedups()
    assert c.details == {"step_tracker": False, "flops_tokens": False, "records_line": True}
    assert "FLOPs/tokens: python (stepwatch.metrics._cmetrics not importable" in c.summary


def test_nccl_env_rules():
    checks = {c.name: c for c in check_nccl_env({"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "^lo,^docker",
                                                 "NCCL_TIMEOUT": "1800", "NCCL_ALGO": "Ring"})}
    assert checks["NCCL_DEBUG"].status == "warn" and "WARN" in checks["NCCL_DEBUG"].action
    assert checks["NCCL_SOCKET_IFNAME"].status == "warn" and "^lo,docker" in checks["NCCL_SOCKET_IFNAME"].action
    assert checks["NCCL_TIMEOUT"].status == "warn" and "init_process_group" in checks["NCCL_TIMEOUT"].action
    assert checks["NCCL_ALGO"].status == "warn"
    assert checks["nccl env"].details["set"]["NCCL_DEBUG"] == "INFO"
    clean = check_nccl_env({"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "^lo,docker"})
    assert [c.status for c in clean] == ["ok"]


def test_torchrun_env_rules():
    (c,) = check_torchrun_env({})
    assert c.status == "info"
    (c,) = check_torchrun_env({"RANK": "4", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert c.status == "warn" and "RANK=4" in c.summary
    cs = check_torchrun_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                             "MASTER_ADDR": "h", "MASTER_PORT": "29500", "CUDA_VISIBLE_DEVICES": "2,3"})
    assert cs[0].status == "ok"
    assert "CUDA_DEVICE_ORDER" in cs[1].action


def test_gpu_checks_with_fake_nvml():
    healthy = check_nvidia(FakeNvml(SCRIPT))
    assert healthy[0].name == "nvidia driver" and "550.54.15" in healthy[0].summary
    assert "12.4" in healthy[0].summary
    assert [c.status for c in healthy[1:]] == ["ok", "ok"]
    assert "GPM yes" in healthy[1].summary
    hot = check_nvidia(FakeNvml([_tick(88, 1400, THERMAL, 0.9, 0.6, 0.3)], gpm_supported=False))
    assert hot[1].status == "warn" and "88 C" in hot[1].summary and "GPM no" in hot[1].summary
    broken = check_nvidia(FakeNvml([_tick(70, 1980, 0, 0.9, 0.6, 0.3, dbe=2)]))
    assert broken[1].status == "fail" and "uncorrectable" in broken[1].summary

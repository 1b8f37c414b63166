"""Trace analysis (stepwatch.traces): HTA 0.5.0's numbers on real GPU traces, and the definitions.

The reference numbers (tests/unit/data/hta_reference.json) were computed by HolisticTraceAnalysis
0.5.0 itself, with benchmarks/hta_reference.py, on the traces in ../shared/traces/ (real A100,
V100 and MI250 traces from HTA's own test data).
"""

import gzip
import json
import os
import subprocess
import sys

import pytest

from stepwatch.cli import main
from stepwatch.traces import analyse, analyse_with_findings, trace_files
from stepwatch.traces import kernels as K
from stepwatch.traces.reader import EventReader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACES = os.path.join(os.path.dirname(ROOT), "shared", "traces")
REF = json.load(open(os.path.join(ROOT, "tests", "unit", "data", "hta_reference.json")))["traces"]
OVERLAP_NAMED = ("a100-ddp-2rank-rank0.json.gz", "sampled-128rank-rank0.json.gz", "sampled-128rank-rank1.json.gz")

needs_traces = pytest.mark.skipif(not os.path.isdir(TRACES), reason="../shared/traces/ not present")


@needs_traces
@pytest.mark.parametrize("name", sorted(REF))
def test_temporal_breakdown_overlap_and_idle_time_match_hta(name):
    ref = REF[name]
    got = analyse(os.path.join(TRACES, name))
    if "error" in ref["temporal"]:  # HTA raises on a trace without kernels (a100-cupti-counters)
        assert got["temporal"] is None and got["note"] == "no GPU kernels"
        assert got["comm_comp_overlap_pct"] is None and got["gaps"] == []
        return
    _matches_hta(got, ref, pct=1.0, overlap=1.5, idle_share=0.01, idle_us=1.0)
    assert name not in OVERLAP_NAMED or got["comm_comp_overlap_pct"] is not None


def _matches_hta(got, ref, *, pct, overlap, idle_share, idle_us):
    """stepwatch's analysis against HTA's numbers for the same trace (benchmarks/hta_reference.py's
    format): the temporal breakdown within ``pct`` points, the comm/compute overlap within
    ``overlap`` points (null in both, or in neither), and the idle time per stream by category
    (host wait / kernel wait / other, µs) within ``idle_share`` of the stream's idle time plus
    ``idle_us``."""
    for k in ("idle_pct", "compute_pct", "non_compute_pct"):
        assert abs(got["temporal"][k] - ref["temporal"][k]) <= pct, (k, got["temporal"], ref["temporal"])
    if ref["comm_comp_overlap_pct"] is None:
        assert got["comm_comp_overlap_pct"] is None
    else:
        assert abs(got["comm_comp_overlap_pct"] - ref["comm_comp_overlap_pct"]) <= overlap
    for stream, cats in ref["idle_breakdown_us"].items():
        mine = got["idle_breakdown"][stream]
        total = sum(cats.values()) or 1.0
        for cat, us in cats.items():
            assert abs(mine[f"{cat}_us"] - us) <= idle_share * total + idle_us, (stream, cat, mine, cats)


def _write(path, events, **meta):
    with open(path, "w") as f:
        json.dump({**meta, "traceEvents": events}, f)
    return str(path)


def _synthetic(tmp_path, name="t.json"):
    """Two ProfilerSteps; GPU events out of time order in the file; fractional (ns) timestamps."""
    X = lambda cat, name, ts, dur, tid=1, **args: {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid,
                                                   "ts": ts, "dur": dur, "args": args}
    events = [
        X("gpu_memcpy", "elementwise_kernel_add", 60.4, 10, tid=7, stream=7, correlation=2),
        X("kernel", "ncclKernel_AllReduce_RING_LL_Sum_float", 25, 30, tid=2, stream=2, correlation=4),
        X("user_annotation", "ProfilerStep#1", 0, 100),
        X("user_annotation", "ProfilerStep#2", 100, 100),
        X("cuda_runtime", "cudaLaunchKernel", 10, 1, correlation=1),
        X("cuda_runtime", "cudaLaunchKernel", 20, 1, correlation=2),
        X("cuda_runtime", "cudaLaunchKernel", 22, 1, correlation=4),
        X("cuda_runtime", "cudaLaunchKernel", 110, 1, correlation=3),
        X("cpu_op", "aten::foo", 50, 600),  # long enough (>= 0.5 ms) to be kept to name a gap
        X("cpu_op", "aten::short", 54, 10),  # shorter ops are not kept
        X("kernel", "ampere_sgemm_128x64_tn", 12.2, 20.6, tid=7, stream=7, correlation=1),
        X("kernel", "late_kernel_in_last_step", 120, 50, tid=7, stream=7, correlation=3),
        {"ph": "f", "cat": "ac2g", "id": 1, "ts": 12, "pid": 0, "tid": 7},
    ]
    return _write(tmp_path / name, events, distributedInfo={"rank": 3})


def test_definitions_on_a_hand_made_trace(tmp_path):
    got = analyse(_synthetic(tmp_path))
    # Rounded (start up, end down): gemm 13-32, nccl 25-55, elementwise 61-70; the kernel launched
    # in the last ProfilerStep (correlation 3) is dropped. Span 57, busy 51, compute 19 + 9.
    assert got["rank"] == 3 and got["steps"]["gpu_events_dropped"] == 1 and got["steps"]["ns_rounding"]
    assert got["temporal"] == {"idle_pct": 10.53, "compute_pct": 49.12, "non_compute_pct": 40.35, "span_us": 57.0}
    assert got["comm_comp_overlap_pct"] == 23.33  # comm 25-55 under compute 25-32: 7 of 30
    assert got["idle_breakdown"]["7"]["kernel_wait_us"] == 29.0  # launched at 20, before the gemm ended
    # HTA's launch delay: the kernel's start less the launch call's end (memcpy: 61 - 21)
    assert got["launch"]["delay_us"]["max"] == 40.0 and got["launch"]["queue_empty_count"] == 0
    (gap,) = [g for g in got["gaps"] if g["dur_us"] == 6.0]
    assert gap["cpu_op"] == "aten::foo" and gap["step"] == 1 and gap["cause"] == "cpu"
    cls = got["kernels"]["classes"]
    assert cls["gemm"]["count"] == 1 and cls["communication"]["count"] == 1
    assert cls["elementwise_reduction"]["count"] == 1


@needs_traces
@pytest.mark.parametrize("name", sorted(n for n in REF if REF[n]["launch_delay_us"].get("n")))
def test_launch_delays_match_htas_cuda_kernel_launch_stats(name):
    ref = REF[name]["launch_delay_us"]
    got = analyse(os.path.join(TRACES, name))["launch"]
    assert got["kernels_with_launch"] == ref["n"]
    assert {k: float(v) for k, v in got["delay_us"].items()} == {k: ref[k] for k in ("median", "p90", "p99", "max")}


def test_launch_delay_starts_when_the_launch_call_returns_and_counts_launches_only(tmp_path):
    """HTA's definition (``cuda_kernel_launch_stats``): kernel start less the end of its
    cudaLaunchKernel / cudaLaunchKernelExC / cudaMemcpyAsync / cudaMemsetAsync, clipped at 0. A
    launch call that blocks (lazy module loading: 3 s on the A100 trace) is no delay when its kernel
    starts before the call returns; a synchronous copy's call is no launch."""
    X = lambda cat, name, ts, dur, **args: {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts,
                                            "dur": dur, "args": args}
    p = _write(tmp_path / "t.json", [
        X("cuda_runtime", "cudaLaunchKernel", 0, 3_000_000, correlation=1),  # blocks 3 s
        X("kernel", "ampere_sgemm_128x64_tn", 2_999_997, 10, stream=7, correlation=1),
        X("cuda_runtime", "cudaLaunchKernelExC", 3_000_100, 5, correlation=2),
        X("kernel", "ampere_sgemm_128x64_nn", 3_000_125, 10, stream=7, correlation=2),
        X("cuda_runtime", "cudaMemcpy", 3_000_200, 50, correlation=3),  # synchronous: HTA leaves it out
        X("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 3_000_220, 20, stream=7, correlation=3),
        X("cuda_runtime", "cudaMemsetAsync", 3_000_300, 2, correlation=4),
        X("gpu_memset", "Memset (Device)", 3_000_310, 1, stream=7, correlation=4),
    ])
    got = analyse(p)["launch"]
    assert got["kernels_with_launch"] == 3
    assert got["delay_us"] == {"median": 8, "p90": 20, "p99": 20, "max": 20}


def test_reader_streams_any_chunking_and_both_chrome_forms(tmp_path):
    p = _synthetic(tmp_path)
    whole = json.load(open(p))
    for chunk in (1, 7, 64, 1 << 20):
        r = EventReader(p, chunk=chunk)
        assert list(r) == whole["traceEvents"] and r.meta == {"distributedInfo": {"rank": 3}}
    bare = tmp_path / "bare.json.gz"
    with gzip.open(bare, "wt") as f:
        json.dump(whole["traceEvents"], f)
    assert list(EventReader(str(bare), chunk=5)) == whole["traceEvents"]
    assert analyse(str(bare))["temporal"] == analyse(p)["temporal"]


def test_hip_and_cuda_kernel_names_are_classified():
    for name, cls in [
        ("Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1", "gemm"),  # rocBLAS / Tensile
        ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128_32x3>(Params)", "gemm"),
        ("sm80_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize64x64x16", "gemm"),
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "gemm"),  # cuBLAS 13 on the H200 (2026-12-04)
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>(Params)", "attention"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
        ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "communication"),
        ("Memset (Device)", "memcpy_memset"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "elementwise_reduction"),
        # FBGEMM-GPU (the sampled 128-rank traces): "fbgemm" is no GEMM; its GEMMs still are
        ("void split_embedding_codegen_forward_unweighted_kernel<c10::Half, float>(at::GenericPackedTensorAccessor"
         "<long, 1ul, at::RestrictPtrTraits, int>, fbgemm_gpu::FixedDivisor)", "elementwise_reduction"),
        ("void at::native::vectorized_elementwise_kernel<4, fbgemm_gpu::_hfp8_to_float_gpu_t>(int)", "elementwise_reduction"),
        ("void fbgemm_gpu::permute_2D_data_kernel<false, int, int, decltype(nullptr)>(int, int)", "other"),
        ("void fbgemm_gpu::f8f8bf16_rowwise_gemm_kernel<cutlass::half_t>(Params)", "gemm"),
        # cuDNN's implicit-GEMM convolutions (the V100 trace): "relu" / "stridedB" are their epilogue/layout
        ("cudnn_infer_volta_scudnn_128x64_relu_medium_nn_v1", "gemm"),
        ("cudnn_infer_volta_scudnn_128x64_stridedB_interior_nn_v1", "gemm"),
        ("void wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>(int, int, int, float const*)", "gemm"),
        ("void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 128, true, 1>(float)", "elementwise_reduction"),
    ]:
        assert K.kernel_class(name, K.hta_type(name)) == cls, name
    assert K.hta_type("Stream Sync") == K.OTHER and K.hta_type("Memcpy DtoH (Device -> Pinned)") == K.MEMORY


@needs_traces
def test_mi250_trace_hip_gemms_and_rocm_launches():
    got = analyse(os.path.join(TRACES, "mi250-rocm62-toy-train.json.gz"))
    assert got["kernels"]["classes"]["gemm"]["count"] == 2  # rocBLAS Cijk_ kernels
    assert got["launch"]["kernels_with_launch"] > 0  # hipLaunchKernel / hipExtModuleLaunchKernel
    assert got["gaps"][0]["cpu_op"] == "hipLaunchKernel"


@needs_traces
def test_findings_carry_the_sheets_diagnosis_and_action():
    kinds = lambda n: {f["kind"]: f for f in analyse_with_findings(os.path.join(TRACES, n))["findings"]}
    dense = kinds("v100-single-rank0.json.gz")
    assert list(dense) == ["trace_dense"] and "healthy" in dense["trace_dense"]["diagnosis"]
    ddp = kinds("a100-ddp-2rank-rank0.json.gz")
    assert "gradient_as_bucket_view" in ddp["allreduce_not_overlapped"]["action"]
    assert "CUDA Graphs" in ddp["trace_idle_gaps"]["action"] and "15.7 ms" in ddp["trace_idle_gaps"]["summary"]
    assert "cudaEventSynchronize" in ddp["trace_host_sync"]["summary"]
    assert "torch.compile" in kinds("mi250-rocm62-toy-train.json.gz")["trace_tiny_kernels"]["action"]


@needs_traces
def test_cli_json_is_one_object_per_rank_with_the_documented_keys(capsys):
    assert main(["trace", TRACES, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out) == len([n for n in os.listdir(TRACES) if n.endswith(".json.gz")])
    for o in out:
        assert {"rank", "temporal", "comm_comp_overlap_pct", "idle_breakdown", "kernels", "launch", "gaps",
                "findings"} <= set(o)
    assert sorted(o["rank"] for o in out if o["trace"].endswith(("rank0.json.gz", "rank1.json.gz"))) == [0, 0, 0, 1]


@needs_traces
def test_a_trace_of_unknown_rank_has_findings_of_unknown_rank_named_by_its_file(capsys):
    """No distributedInfo and no rank in the name: the object said rank null while its findings
    said rank 0 ("rank 0: ..."). They carry rank null and name the file instead."""
    from stepwatch.record import Finding

    name = "mi250-rocm62-toy-train.json.gz"
    assert main(["trace", os.path.join(TRACES, name), "--json"]) == 0
    o = json.loads(capsys.readouterr().out)[0]
    assert o["rank"] is None and len(o["findings"]) >= 2
    for f in o["findings"]:
        assert f["rank"] is None and f["summary"].startswith(f"{name}: "), (f["rank"], f["summary"])
        assert Finding.from_dict(f).rank is None
    assert main(["trace", os.path.join(TRACES, name)]) == 0  # the terminal's tables take it too
    out = capsys.readouterr().out
    assert "trace_idle_gaps" in out and "rank 0" not in out


def test_cli_errors_name_the_argument(tmp_path, capsys):
    assert main(["trace", str(tmp_path / "nope.json")]) == 2
    assert "PATH" in capsys.readouterr().err
    (tmp_path / "run.json").write_text("{}")
    assert main(["capture", str(tmp_path), "--steps", "0"]) == 2
    assert "--steps must be between 1 and 100, got 0" in capsys.readouterr().err
    assert main(["capture", str(tmp_path / "x"), "--steps", "3"]) == 2
    assert "no run.json" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [{"ph": "X"')
    assert main(["trace", str(bad)]) == 1
    assert "not valid JSON" in capsys.readouterr().err


def test_directories_take_trace_files_not_metadata(tmp_path):
    _synthetic(tmp_path, "capture-1-steps5-7.rank0.trace.json")
    (tmp_path / "capture-1-steps5-7.rank0.json").write_text("{}")
    assert trace_files([str(tmp_path)]) == [str(tmp_path / "capture-1-steps5-7.rank0.trace.json")]


def test_worker_process_does_not_import_torch_and_writes_0600(tmp_path):
    out = tmp_path / "a.analysis.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    r = subprocess.run([sys.executable, "-m", "stepwatch.traces.worker", "--trace", _synthetic(tmp_path), "--out", str(out),
                        "--rank", "3", "--step", "5", "--context", '{"capture": 2}'], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["torch_imported"] is False and got["temporal"]["idle_pct"] == 10.53
    assert all(f["data"]["capture"] == 2 for f in got["findings"]) and got["findings"]
    assert os.stat(out).st_mode & 0o777 == 0o600


def test_a_host_sync_before_a_gap_is_named_with_its_call_site(tmp_path):
    X = lambda cat, name, ts, dur, tid=1, **args: {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid,
                                                   "ts": ts, "dur": dur, "args": args}
    p = _write(tmp_path / "sync.json", [
        X("python_function", "train.py(42): train_step", 900, 3500),
        X("python_function", "site-packages/lib.py(7): wrapper", 950, 3400),  # library code: not the call site
        X("cuda_runtime", "cudaLaunchKernel", 990, 5, correlation=1),
        X("cpu_op", "aten::item", 1005, 101),
        X("cuda_runtime", "cudaStreamSynchronize", 1010, 95),
        X("cuda_runtime", "cudaLaunchKernel", 4090, 5, correlation=2),
        X("kernel", "ampere_sgemm_128x64_tn", 1000, 100, tid=7, stream=7, correlation=1),
        X("kernel", "ampere_sgemm_128x64_tn", 4100, 100, tid=7, stream=7, correlation=2),
    ])
    got = analyse_with_findings(p)
    gap = got["gaps"][0]
    assert gap["dur_us"] == 3000 and gap["cause"] == "host_sync" and gap["host_sync"] == "aten::item"
    assert gap["call_site"] == "train.py(42): train_step"
    (f,) = [f for f in got["findings"] if f["kind"] == "trace_host_sync"]
    assert "aten::item" in f["summary"] and "train.py(42): train_step" in f["summary"]
    assert got["launch"]["queue_empty_count"] == 1  # the second launch came after the GPU drained


def test_a_cuda_trace_stepwatch_captured_on_an_h200_matches_hta():
    """A real capture: scripts/gpu_check_ddp.py on an NVIDIA H200 (bf16 MLP under DDP over NCCL, world
    size 1, steps 175-177 captured by stepwatch), with HTA 0.5.0's numbers for the same file beside it
    (h200_ddp_capture.hta.json, from benchmarks/hta_reference.py). Its GEMMs are cuBLAS 13's ``nvjet``
    kernels, which the first analysis on the device put under "other"."""
    data = os.path.join(ROOT, "tests", "unit", "data")
    hta = json.load(open(os.path.join(data, "h200_ddp_capture.hta.json")))["trace"]
    got = analyse(os.path.join(data, "h200_ddp_capture.trace.json.gz"))
    _matches_hta(got, hta, pct=0, overlap=0, idle_share=0, idle_us=0)  # the same numbers exactly
    assert got["temporal"]["span_us"] == hta["temporal"]["kernel_time_us"]
    assert hta["comm_comp_overlap_pct"] is None  # one rank: no NCCL kernel
    assert got["steps"]["stepwatch_steps"] == [175, 176, 177]
    classes = got["kernels"]["classes"]
    assert classes["gemm"]["count"] == 33 and classes["gemm"]["time_pct"] > 60  # the window's nvjet GEMMs
    assert "other" not in classes or classes["other"]["count"] == 0


def test_short_names_keep_a_copys_memory_kinds_and_tell_two_kernels_of_one_name_apart():
    """``Memcpy HtoD (Pageable -> Device)`` read as ``Memcpy HtoD  Device`` (the ``>`` of ``->``
    closed the parenthesis): pageable and pinned copies, which the pin_memory advice tells apart,
    looked the same. Two kernels of one name in the top list keep their template arguments."""
    for name in ("Memcpy HtoD (Pageable -> Device)", "Memcpy HtoD (Pinned -> Device)", "Memset (Device)"):
        assert K.short_name(name) == name
    add = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int, float)"
    relu = "void at::native::vectorized_elementwise_kernel<4, at::native::threshold_kernel<float>>(int, float)"
    assert K.short_names([add, "volta_sgemm_64x64_nt", relu]) == [
        "at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "volta_sgemm_64x64_nt",
        "at::native::vectorized_elementwise_kernel<4, at::native::threshold_kernel<float>>"]


def test_cpu_gaps_of_a_long_cpu_capture_take_linear_time():
    """A CPU-only capture's gaps walked every thread's ops from the first for each step: 16,000
    steps of 20 ops took 106 s (about 40,000 would pass the capture worker's 600 s CPU limit).
    The bound here is generous (the walk now takes well under a second); the old walk needed
    over a minute for these 30,000 steps. The gaps are the same either way (checked on a small one)."""
    import time as _time

    def pass1(steps):
        p1 = analyse.__globals__["_Pass1"]()
        for i in range(steps):
            t = i * 100.0
            p1.steps.append((t, t + 100.0, i, 1, "profiler"))
            p1.aten.setdefault(1, []).extend([[t + 10.0, t + 20.0], [t + 22.0, t + 30.0], [t + 32.0, t + 40.0],
                                              [t + 50.0, t + 60.0 + (i % 7)]])
        p1.aten_sorted[1] = True
        return p1

    cpu_gaps = analyse.__globals__["_cpu_gaps"]
    small = cpu_gaps(pass1(50), 3)
    assert [(g["dur_us"], g["step"]) for g in small] == [(40.0, 49), (40.0, 42), (40.0, 35)]
    t0 = _time.process_time()
    big = cpu_gaps(pass1(30_000), 3)
    assert _time.process_time() - t0 < 5.0 and len(big) == 3 and big[0]["dur_us"] == 40.0

"""The hang verdict from the stacks, when the ranks wait in a collective stepwatch does not time.

The snapshots here are as the sidecars write them; the frames are those py-spy and faulthandler
printed for a real 2-rank gloo job (tests/integration/test_hang_untimed.py): rank 0 in
``dist.all_reduce`` of its own, rank 1 in ``time.sleep`` before it, both at step 6, phase
``other``, no collective open on the board.
"""

from stepwatch.watchdog import verdict as hang

WAITS_PYSPY = ["all_reduce (torch/distributed/distributed_c10d.py:3252)",
               "_exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)",
               "<module> (job.py:27)"]
SLEEPS_PYSPY = ["<module> (job.py:22)"]
SITE = "/venv/lib/python3.11/site-packages/torch/distributed"
BARRIER_FH = [f"barrier ({SITE}/distributed_c10d.py:4150)", f"wrapper ({SITE}/c10d_logger.py:83)",
              "train_loop (/w/train.py:88)", "<module> (/w/train.py:120)"]
BUSY_FH = ["score (/w/metrics.py:12)", "train_loop (/w/train.py:86)", "<module> (/w/train.py:120)"]
BACKWARD = ["_engine_run_backward (torch/autograd/graph.py:979)", "Tensor.backward (torch/_tensor.py:623)",
            "<module> (job.py:41)"]


def _snap(frames, step=6, phase="other", colls=()):
    # The DDP buckets of the step, timed by the comm hook, all completed: nothing is open.
    return {"step": step, "phase": phase, "collectives": list(colls), "top_frames": list(frames)}


def _done(seq):
    return {"op": "allreduce", "group": 0, "seq": seq, "bytes": 4096, "enter_ns": seq, "exit_ns": seq + 1,
            "completed": True, "step": 5}


def test_the_rank_sleeping_outside_an_untimed_all_reduce_is_the_laggard():
    v = hang.verdict({0: _snap(WAITS_PYSPY), 1: _snap(SLEEPS_PYSPY)}, 2)
    assert v["verdict"] == "laggard" and v["laggards"] == [1] and v["waiting"] == [0], v
    assert v["collective"]["op"] == "allreduce" and v["collective"]["step"] == 6
    assert v["collective"]["call_site"] == "<module> (job.py:27)"
    assert "stacks" in v["collective"]["source"]


def test_a_busy_rank_outside_a_barrier_with_faulthandler_paths_and_completed_timed_collectives():
    snaps = {0: _snap(BARRIER_FH, colls=[_done(1)]), 1: _snap(BARRIER_FH, colls=[_done(1)]),
             2: _snap(BUSY_FH, colls=[_done(1)])}
    v = hang.verdict(snaps, 3)
    assert v["laggards"] == [2] and v["waiting"] == [0, 1] and v["collective"]["op"] == "barrier", v
    assert v["collective"]["call_site"] == "train_loop (/w/train.py:88)"


def test_report_summary_names_the_laggard_and_the_untimed_collective():
    snaps = {0: {**_snap(WAITS_PYSPY), "pid": 10, "host": "h"}, 1: {**_snap(SLEEPS_PYSPY), "pid": 11, "host": "h"}}
    rep = hang.build_report(1, snaps, 2, timeout_s=5.0, detected_after_s=5.0, action="dump", run_dir="/r")
    assert rep["verdict"] == "laggard" and rep["laggards"] == [1] and rep["waiting"] == [0]
    assert "Laggard: rank 1" in rep["summary"] and "allreduce" in rep["summary"], rep["summary"]
    assert "job.py:27" in rep["summary"] and "job.py:22" in rep["summary"]


def test_a_ddp_backward_wait_is_still_judged_by_phases():
    """DDP's AllReduce waits inside backward, where Python shows autograd's frames, not
    torch.distributed's: no stack shows a collective, so the phases decide as before."""
    v = hang.verdict({0: _snap(BACKWARD, phase="backward"), 1: _snap(SLEEPS_PYSPY, phase="forward")}, 2)
    assert v["laggards"] == [1] and v["waiting"] == [0] and "phases" in v["collective"]["source"]


def test_a_rank_in_backward_or_without_frames_is_never_named_from_the_stacks():
    # Rank 1 may wait in DDP's AllReduce (in backward), rank 2's stacks are missing: only rank 3,
    # in its own code, is named.
    snaps = {0: _snap(WAITS_PYSPY), 1: _snap(BACKWARD, phase="backward"), 2: _snap([]), 3: _snap(SLEEPS_PYSPY)}
    v = hang.verdict(snaps, 4)
    assert v["laggards"] == [3] and v["waiting"] == [0], v
    # Every rank with frames waits in a collective: the stacks name no one, the phases decide.
    v = hang.verdict({0: _snap(WAITS_PYSPY), 1: _snap([])}, 2)
    assert v["laggards"] == [] and v["verdict"] == "unknown"


def test_an_open_timed_collective_still_decides_first():
    open_ = {"op": "allreduce", "group": 0, "seq": 2, "bytes": 4096, "enter_ns": 9, "exit_ns": 0,
             "completed": False, "step": 6}
    snaps = {0: _snap(SLEEPS_PYSPY, colls=[_done(1), open_]), 1: _snap(WAITS_PYSPY, colls=[_done(1)])}
    v = hang.verdict(snaps, 2)
    assert v["laggards"] == [1] and v["collective"]["source"] == "comm_hook"


def test_a_laggard_waiting_in_another_collective_is_named_at_its_line_not_stepwatchs_wrapper():
    """Uneven steps without Join (a real 2-rank gloo job's frames): rank 1 waits in DDP's
    AllReduce of its last step, rank 0 left the loop and waits in ``dist.barrier()``. The summary
    said rank 0 was "in BlockedTimer._wrap_wait.<locals>.wait (stepwatch/comm/blocked.py:168)":
    stepwatch's own wait wrapper, and not that rank 0 is in a collective too."""
    barrier = ["BlockedTimer._wrap_wait.<locals>.wait (stepwatch/comm/blocked.py:168)",
               "barrier (torch/distributed/distributed_c10d.py:5356)",
               "_exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)",
               "BlockedTimer._wrap.<locals>.collective (stepwatch/comm/blocked.py:150)", "<module> (job.py:16)"]
    open_ = {"op": "allreduce", "group": 0, "seq": 60, "bytes": 4096, "enter_ns": 9, "exit_ns": 0,
             "completed": False, "step": 59}
    snaps = {0: {**_snap(barrier, step=58), "pid": 10, "host": "h"},
             1: {**_snap(BACKWARD, step=59, phase="backward", colls=[open_]), "pid": 11, "host": "h"}}
    rep = hang.build_report(1, snaps, 2, timeout_s=5.0, detected_after_s=5.0, action="dump", run_dir="/r")
    assert rep["laggards"] == [0] and "stepwatch/" not in rep["summary"], rep["summary"]
    assert ("Rank 0 is at step 58, phase other, in barrier (torch/distributed/distributed_c10d.py:5356) called "
            "from <module> (job.py:16): it waits in another collective (barrier) than the allreduce") in rep["summary"]
    # A laggard in its own code reads as before.
    snaps[0] = {**_snap(SLEEPS_PYSPY, step=58), "pid": 10, "host": "h"}
    rep = hang.build_report(1, snaps, 2, timeout_s=5.0, detected_after_s=5.0, action="dump", run_dir="/r")
    assert "Rank 0 is at step 58, phase other, in <module> (job.py:22)." in rep["summary"], rep["summary"]

"""Evaluation spans and checkpoint saves on the loop shapes real scripts use, each a small stand-in
written here: a validation whose metric is computed after its last model call (sklearn, COCOeval,
BLEU over the collected predictions; Lightning's ``on_validation_epoch_end``), and Hugging Face's
checkpoint format (safetensors: ``save_pretrained``, the Trainer's and Accelerate's saves). Neither
may look like a slow step. The phase identity must hold on every record."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from test_steps import SleepyData as _Samples  # the same samples (16 -> 4); a fetch may sleep

pytestmark = pytest.mark.usefixtures("both_tracker_cores")  # tests/conftest.py

METRIC_S = 0.06  # the metric's CPU time, after the validation's last model call


def _identity_holds(r, tol=1e-6):
    parts = r.data_wait_s + r.forward_s + r.backward_s + r.optimizer_s + r.other_s
    return abs(parts - r.step_s) <= tol


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _metric(preds, labels):
    """A metric over the collected predictions (sklearn, COCOeval, BLEU): CPU work, no model call."""
    t = time.perf_counter()
    while time.perf_counter() - t < METRIC_S:
        pass
    return float((torch.cat(preds) - torch.cat(labels)).abs().mean())


def _validate(m, val):
    """The validation and its metric; its wall time on the loop's clock, from before ``iter(val)``
    to after the metric."""
    t0 = time.perf_counter()
    m.eval()
    preds, labels = [], []
    with torch.no_grad():
        for x, y in val:
            preds.append(m(x))
            labels.append(y)
    _metric(preds, labels)
    m.train()
    return time.perf_counter() - t0


@pytest.mark.parametrize("where", ["mid-epoch", "epoch end"])
def test_a_validations_metric_after_its_last_call_is_evaluation_not_the_next_step(sw, where):
    """A validation every 4 steps (mid-epoch), or at each epoch's end (Lightning's loop; the next
    epoch starts at ``iter(train)``), then its metric. The span ended at its last model call: the
    metric's 60 ms were the next step's ``other_s`` (a step_time_spike) and ``eval_s`` had only
    the model calls. The span now runs to where the next training work starts (the next training
    fetch). After the last step there is none: the span ends at its last call (what the script
    does then until shutdown, plots or uploads, was evaluation when it ran to shutdown), or at the
    training loader's end if that comes after it (mid-epoch here), which is the span's."""
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    train = DataLoader(_Samples(32), batch_size=4)  # 8 steps an epoch
    val = DataLoader(_Samples(12), batch_size=4)
    walls, after = [], []  # validation wall times; the index of the record after each
    epochs = 1 if where == "mid-epoch" else 2
    step = 0
    for _ in range(epochs):
        for x, y in train:
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if where == "mid-epoch" and step % 4 == 0:
                walls.append(_validate(m, val))
                after.append(step)
        if where == "epoch end":
            walls.append(_validate(m, val))
            after.append(step)
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    tail = [r for r in mem.records if r.tail]
    assert len(recs) == 8 * epochs and len(tail) == 1, mem.records
    assert all(_identity_holds(r) for r in recs), recs
    for k, wall in zip(after, walls):
        r = recs[k] if k < len(recs) else tail[0]  # the last validation comes after the last step
        if r.tail and where == "epoch end":  # no fetch after the metric: the span ends at the last call
            assert 0 < r.eval_s <= wall - METRIC_S * 0.8, (k, wall, r)
            continue
        # mid-epoch, the training loader's end (its last fetch) comes after the last validation's
        # metric, and is the open span's: the tail holds the metric too
        assert wall * 0.9 <= r.eval_s <= wall + 0.05, (k, wall, r)
        if not r.tail:
            # the metric's 60 ms are not the next step's (its forward may be slow on a loaded
            # machine: torch's own intra-op threads wait for a core; that is the step's, rightly)
            assert r.other_s < METRIC_S / 2, (k, r)
    assert not [f for f in mem.findings if f.kind == "step_time_spike" and f.data.get("other_s", 0) > METRIC_S / 2], mem.findings


def test_a_validations_metric_without_a_training_dataloader_is_evaluation(sw):
    """A loop over tensors it holds (no training DataLoader): the training forward after the
    validation and its metric is where the span ends."""
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    val = DataLoader(_Samples(12), batch_size=4)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    walls = []
    for i in range(6):
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i in (0, 2):  # the first: the session's first fetch scans for models (its own time)
            walls.append(_validate(m, val))
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6 and all(_identity_holds(r) for r in recs), recs
    walls, r = walls[1:], recs[3]
    assert walls[0] * 0.9 <= r.eval_s <= walls[0] + 0.05, (walls, r)
    assert r.other_s < METRIC_S / 2, r


def test_a_validation_before_an_explicit_step_end_is_evaluation_to_that_end(sw):
    """``stepwatch.step()`` at the iteration's end, the validation and its metric inside the
    iteration: the span runs to the step's end (the metric was that step's ``other_s``)."""
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    train = DataLoader(_Samples(24), batch_size=4)
    val = DataLoader(_Samples(12), batch_size=4)
    walls = []
    for i, (x, y) in enumerate(train):
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i == 2:
            walls.append(_validate(m, val))
        stepwatch.step()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6 and all(_identity_holds(r) for r in recs), recs
    r = recs[2]
    assert walls[0] * 0.9 <= r.eval_s <= walls[0] + 0.05, (walls, r)
    assert r.other_s < METRIC_S / 2, r


def test_the_training_fetch_after_a_validation_is_data_wait_not_evaluation(sw):
    """What the span's old end (its last call or fetch) protected: the next training fetch, after
    the metric, is the step's ``data_wait_s``. The span ends where that fetch starts; it must not
    run on to the forward that closes it (the slow fetch would be counted twice, or as eval)."""
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    train = DataLoader(_Samples(24, 0.01), batch_size=4)  # 40 ms a fetch
    val = DataLoader(_Samples(8), batch_size=4)
    walls = []
    for i, (x, y) in enumerate(train):
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i == 2:
            walls.append(_validate(m, val))
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6 and all(_identity_holds(r) for r in recs), recs
    r = recs[3]
    assert walls[0] * 0.9 <= r.eval_s <= walls[0] + 0.02, (walls, r)
    assert r.data_wait_s >= 0.04 * 0.9, r


def _train_and_save(m, save, steps=6, at=3):
    """A plain loop that saves after step ``at`` (the save is in the next step's record)."""
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    for i in range(steps):
        nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i == at:
            save(m)
    return at + 1


def _big_model():
    """A model with a 16 MB buffer: a save that takes a few ms to write (made before the loop:
    filling it is ms of page faults)."""
    m = _model()
    m.register_buffer("buf", torch.ones(4 << 20))
    return m


@pytest.mark.parametrize("how", ["save_file", "save_model", "a library's own name for save_file"])
def test_a_safetensors_save_is_a_checkpoint_not_step_time(sw, tmp_path, how):
    """Hugging Face's weights format: safetensors' ``save_file`` (``save_model`` calls it) was no
    checkpoint: its time was the step's ``other_s`` (checkpoint_s 0, a slow step). A library that
    imported it by name before stepwatch started (transformers' and accelerate's ``from
    safetensors.torch import save_file as safe_save_file``) holds the function itself: its name
    is timed too, and given back at shutdown."""
    st = pytest.importorskip("safetensors.torch")
    import types

    lib = types.ModuleType("_lib_saving_with_safetensors")  # imported before init, as transformers is
    exec("from safetensors.torch import save_file as safe_save_file", lib.__dict__)
    sys.modules[lib.__name__] = lib
    try:
        stepwatch, mem, start = sw
        start()
        path = str(tmp_path / "model.safetensors")

        def save(m):
            if how == "save_file":
                st.save_file(m.state_dict(), path)
            elif how == "save_model":
                st.save_model(m, path)
            else:
                lib.safe_save_file(m.state_dict(), path)

        k = _train_and_save(_big_model(), save)
        stepwatch.shutdown()
        assert lib.safe_save_file is st.save_file and not hasattr(st.save_file, "__wrapped__")  # given back
    finally:
        del sys.modules[lib.__name__]
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6 and all(_identity_holds(r) for r in recs), recs
    r = recs[k]
    assert r.checkpoint_s > 0 and r.checkpoint_bytes == os.path.getsize(path), r
    assert r.other_s < r.checkpoint_s, r
    assert all(q.checkpoint_s == 0 for q in recs if q is not r), recs


def test_save_pretrained_is_one_checkpoint_with_its_safetensors_bytes(sw, tmp_path):
    """transformers' ``save_pretrained`` (the Trainer's weights too): the whole call is the
    checkpoint (its first call spends most of its time renaming the weights back, before any
    file is written), and its bytes are its safetensors files'. It was the step's ``other_s``
    (75 ms of a GPT-2's step, a step_time_spike)."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    stepwatch, mem, start = sw
    start()
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    out = tmp_path / "ckpt"
    for i in range(6):
        ids = torch.randint(0, 64, (2, 8))
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if i == 3:
            t0 = time.perf_counter()
            m.save_pretrained(str(out))
            wall = time.perf_counter() - t0
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6 and all(_identity_holds(r) for r in recs), recs
    r = recs[4]
    weights = sum(os.path.getsize(p) for p in out.glob("*.safetensors"))
    assert r.checkpoint_s > 0 and r.checkpoint_bytes == weights > 0, r
    # The whole call, timed around it here: a few ms once this process has saved before, so it
    # is checked against its own wall time (a load-proof bound), not against the step's other_s.
    assert wall - 1e-3 <= r.checkpoint_s <= wall, (wall, r)


@pytest.mark.parametrize("when", ["before the optimizer", "inside the save, after the first steps"])
def test_safetensors_imported_after_init_is_patched_and_never_imported_by_stepwatch(tmp_path, both_tracker_cores,
                                                                                     when):
    """A script that starts stepwatch first and imports safetensors after: stepwatch imports
    nothing of it, and its saves are checkpoints all the same. Imported before the optimizer, it
    is patched when the optimizer is made; imported late (a save helper's own ``from
    safetensors.torch import save_file``, after steps ran), it was never patched and its save
    was the step's ``other_s``: it is patched as its import finishes, before the helper binds
    the name."""
    pytest.importorskip("safetensors.torch")
    if both_tracker_cores == "python":
        pytest.skip("one process run is enough: the tracker's core plays no part here")
    early = "from safetensors.torch import save_file" if when == "before the optimizer" else ""
    script = textwrap.dedent(f"""
        import os, sys
        import stepwatch
        mem = stepwatch.InMemoryExporter()
        stepwatch.init(dir={str(tmp_path / "run")!r}, console="off", exporters=[mem])
        assert "safetensors" not in sys.modules, "stepwatch imported safetensors"
        import torch
        {early}
        def save(m):
            from safetensors.torch import save_file
            save_file({{"w": m.weight.detach().clone(), "buf": torch.ones(4 << 20)}}, {str(tmp_path / "m.st")!r})
        m = torch.nn.Linear(256, 256)
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        for i in range(4):
            m(torch.randn(4, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
            if i == 1:
                save(m)
        stepwatch.shutdown()
        r = [r for r in mem.records if not r.tail][2]
        print("RESULT", r.checkpoint_s > 0, r.checkpoint_bytes == os.path.getsize({str(tmp_path / "m.st")!r}))
    """)
    _run_expecting(script, "RESULT True True")


def test_torch_distributed_checkpoint_imported_at_the_first_save_is_a_checkpoint(tmp_path, both_tracker_cores):
    """``import torch.distributed.checkpoint as dcp`` inside the save (after the first steps: it is
    heavy, and scripts import it where they save): its ``dcp.save`` was never patched, so the
    checkpoint was the step's ``other_s`` (checkpoint_s ~0: only an inner ``torch.save``). It is
    patched as its import finishes. After shutdown nothing of stepwatch is left on
    ``sys.meta_path``."""
    if both_tracker_cores == "python":
        pytest.skip("one process run is enough: the tracker's core plays no part here")
    script = textwrap.dedent(f"""
        import sys, time, warnings
        import stepwatch
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        mem = stepwatch.InMemoryExporter()
        stepwatch.init(dir={str(tmp_path / "run")!r}, console="off", exporters=[mem])
        import torch
        m = torch.nn.Linear(256, 256)
        m.register_buffer("big", torch.ones(4 << 20))
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        for i in range(4):
            m(torch.randn(4, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
            if i == 1:
                import torch.distributed.checkpoint as dcp
                t = time.perf_counter()
                dcp.save({{"m": m.state_dict()}}, checkpoint_id={str(tmp_path / "ck")!r})
                saved = time.perf_counter() - t
        stepwatch.shutdown()
        r = [r for r in mem.records if not r.tail][2]
        left = [f for f in sys.meta_path if "stepwatch" in type(f).__module__]
        print("RESULT", r.checkpoint_s >= 0.8 * saved, left == [], r.checkpoint_s, saved)
    """)
    _run_expecting(script, "RESULT True True")


def _slow_writer():
    """A DCP file writer whose write takes 0.3 s: an async save still running when the loop waits."""
    import torch.distributed.checkpoint as dcp

    class SlowWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            time.sleep(0.3)
            return super().write_data(plan, planner)

    return SlowWriter


def test_waiting_for_an_async_checkpoint_is_checkpoint_time(sw, tmp_path):
    """torchtitan's pattern: ``dcp.async_save`` returns a future, and the loop waits on it with
    ``future.result()`` before its next save and once more at the end. That wait is what the
    checkpoint costs the training thread: it was the step's ``other_s`` (a slow step), and the
    last one, after the last step, was in no record. Both are ``checkpoint_s`` now; a wait on a
    save that had already finished is nothing. (A writer that takes 0.3 s makes the waits real.)"""
    import warnings

    import torch.distributed.checkpoint as dcp

    SlowWriter = _slow_writer()
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    fut, waits = None, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        for i in range(6):
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i in (1, 3):
                if fut is not None:
                    fut.result()  # the save of step 1 is done by now: no wait
                fut = dcp.async_save({"m": m.state_dict()}, storage_writer=SlowWriter(str(tmp_path / f"ck{i}")))
            if i in (2, 4):
                t = time.perf_counter()
                fut.result()
                waits[i] = time.perf_counter() - t
        t = time.perf_counter()
        fut.result()  # after the last step: done already, nothing
        waits["end"] = time.perf_counter() - t
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    assert len(recs) == 6
    assert all(_identity_holds(r) for r in recs), recs
    for i in (2, 4):  # after step i's optimizer: step i + 1's record, as a save there is
        assert waits[i] > 0.1, waits  # the writer's 0.3 s, less the step since the save
        assert recs[i + 1].checkpoint_s >= 0.9 * waits[i], (i, recs[i + 1], waits)
        assert recs[i + 1].other_s < waits[i] / 2, (i, recs[i + 1], waits)
    assert [r for r in mem.records if r.tail] == []  # the last, finished save's result: nothing


def test_the_wait_for_an_async_checkpoint_after_the_last_step_is_in_the_tail_record(sw, tmp_path):
    """The last ``future.result()`` after the loop waits for the run's last save: the tail record's
    ``checkpoint_s``, so the run's totals count it."""
    import warnings

    import torch.distributed.checkpoint as dcp

    SlowWriter = _slow_writer()
    stepwatch, mem, start = sw
    start()
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(3):
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        fut = dcp.async_save({"m": m.state_dict()}, storage_writer=SlowWriter(str(tmp_path / "ck")))
        t = time.perf_counter()
        fut.result()
        wait = time.perf_counter() - t
    stepwatch.shutdown()
    tail = [r for r in mem.records if r.tail]
    assert wait > 0.1 and len(tail) == 1, (wait, mem.records)
    assert tail[0].checkpoint_s >= 0.9 * wait, (tail, wait)


def test_zeros_consolidation_is_communication_not_a_checkpoint(sw):
    """``ZeroRedundancyOptimizer.consolidate_state_dict(to=0)`` is a collective: each rank but the
    receiver ``torch.save``s its shard into a ``BytesIO`` and broadcasts it (torch's
    ``_broadcast_object``, called here as it calls it, on a one-rank group). It was a checkpoint
    on the sending ranks only: a tail record of a few kB "at 0.002 GB/s" on rank 1 and none on
    rank 0, so the ranks' record counts differed. A save that torch.distributed makes to
    communicate is no checkpoint; a user's own save to a BytesIO still is (uploaded elsewhere)."""
    import io

    import torch.distributed as dist
    from torch.distributed.optim.zero_redundancy_optimizer import _broadcast_object

    stepwatch, mem, start = sw
    start()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        m = _big_model()
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(4, 16), torch.randn(4, 4)
        for i in range(3):
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i == 1:
                _broadcast_object(opt.state_dict(), src_rank=0, group=dist.group.WORLD, device=torch.device("cpu"))
        _broadcast_object(opt.state_dict(), src_rank=0, group=dist.group.WORLD, device=torch.device("cpu"))
        buf = io.BytesIO()
        torch.save(m.state_dict(), buf)  # the user's own in-memory checkpoint: still one
    finally:
        dist.destroy_process_group()
    stepwatch.shutdown()
    recs = [r for r in mem.records if not r.tail]
    tail = [r for r in mem.records if r.tail]
    assert len(recs) == 3 and all(r.checkpoint_s == 0 and r.checkpoint_bytes is None for r in recs), recs
    assert len(tail) == 1 and tail[0].checkpoint_bytes == buf.tell(), tail


def _run_expecting(script, line):
    """Run ``script`` in a fresh interpreter (the imports it makes are its first) with this
    checkout's stepwatch; it must exit 0 and print ``line``."""
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWATCH_")}
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert line in p.stdout, (p.stdout, p.stderr[-3000:])

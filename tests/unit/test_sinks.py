"""TensorBoard, W&B and MLflow sinks (docs/sinks.md), each with the real library, fed by the real
hooks on a small CPU training loop, read back the way a user would: TensorBoard's
EventAccumulator, MlflowClient on a local SQLite store, a W&B offline run's summary and its run
file. Nothing is mocked."""

import glob
import json
import logging
import os
import struct
import sys
import time

import pytest
import torch
import torch.nn as nn

STEPS = 40


def _train(stepwatch, steps=STEPS, *, slow_data_s=0.0, log_loss=None):
    """A seeded SGD loop; returns the losses (as Python floats, read after the loop)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return steps * 4

        def __getitem__(self, i):
            if slow_data_s:
                time.sleep(slow_data_s)
            g = torch.Generator().manual_seed(i)
            return torch.randn(8, generator=g), torch.randn(1, generator=g)

    losses = []
    for x, y in torch.utils.data.DataLoader(Data(), batch_size=4):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if stepwatch is not None:
            stepwatch.log(loss=loss.detach())
        if log_loss is not None:
            log_loss(loss.detach())
    return [float(l) for l in losses]


def _train_plain(steps, each=None):
    """A loop without a DataLoader (a step's record is made when the next one begins, or at
    shutdown: no fetch ends the loop); ``each(i)`` after step ``i``'s optimizer step."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if each is not None:
            each(i)


def _clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("STEPWATCH_", "WANDB_", "MLFLOW_")):
            monkeypatch.delenv(k)


# -- TensorBoard -------------------------------------------------------------------------------


def _scalars(logdir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc, [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_dir_gets_one_step_s_per_step_in_the_rank_folder(sw, tmp_path, monkeypatch):
    stepwatch, mem, start = sw
    tb = tmp_path / "tb"
    monkeypatch.setenv("STEPWATCH_TENSORBOARD", str(tb))
    start(records=False, window=10, data_wait_threshold_ms=1.0)
    _train(stepwatch, slow_data_s=0.001)  # 4 ms of data wait a step: a data_loading finding
    stepwatch.shutdown()

    assert os.listdir(tb) == ["rank0"]
    assert oct(os.stat(tb / "rank0").st_mode & 0o777) == "0o700"
    acc, step_s = _scalars(str(tb / "rank0"), "stepwatch/step_s")
    assert [s for s, _ in step_s] == list(range(STEPS))
    want = {r.step: r.step_s for r in mem.records}
    assert all(abs(v - want[s]) < 1e-6 * max(1.0, want[s]) for s, v in step_s)
    tags = acc.Tags()["scalars"]
    for tag in ("stepwatch/data_wait_s", "stepwatch/forward_s", "stepwatch/backward_s", "stepwatch/scalars/loss"):
        assert tag in tags, tags
    _, loss = _scalars(str(tb / "rank0"), "stepwatch/scalars/loss")
    assert len(loss) == STEPS
    # The finding, as a text summary.
    assert any(f.kind == "data_loading" for f in mem.findings)
    texts = [
        t.tensor_proto.string_val[0].decode()
        for t in acc.Tensors("stepwatch/findings/text_summary")
    ]
    assert any("data_loading" in t for t in texts), texts


def test_tensorboard_gets_every_name_apart_no_made_up_infinity_and_no_made_up_last_step(sw, tmp_path):
    """What a user's logging met in the sinks: two names that clean up to one key ('a:b' and
    'a_b') overwrote each other in every sink; a finite 1e300 became float32 inf in TensorBoard;
    and the tail record (an evaluation after the last step) came out as one more training step,
    step_s 0, at the end of every curve."""
    stepwatch, mem, start = sw
    tb = tmp_path / "tb"
    start(tensorboard=str(tb))
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(6):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        stepwatch.log(**{"a:b": float(i), "a_b": 100.0 + i, "big": 1e300, "ok": 2.0})
    model.eval()
    with torch.no_grad():  # an evaluation after the last step: the tail record
        for _ in range(8):
            model(torch.randn(4, 8))
    stepwatch.log(val_loss=0.5)
    stepwatch.shutdown()
    assert [r.step for r in mem.records if r.tail] == [6]
    acc, step_s = _scalars(str(tb / "rank0"), "stepwatch/step_s")
    assert [s for s, _ in step_s] == list(range(6))  # no step 6 of 0 s
    tags = acc.Tags()["scalars"]
    ab = [t for t in tags if t.startswith("stepwatch/scalars/a_b")]
    assert len(ab) == 2, tags  # one key each
    series = sorted(sorted(v for _, v in _scalars(str(tb / "rank0"), t)[1]) for t in ab)
    assert series == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]]
    assert "stepwatch/scalars/big" not in tags  # beyond float32: left out, as a non-finite value is
    assert [v for _, v in _scalars(str(tb / "rank0"), "stepwatch/scalars/ok")[1]] == [2.0] * 6
    _, val = _scalars(str(tb / "rank0"), "stepwatch/scalars/val_loss")
    _, ev = _scalars(str(tb / "rank0"), "stepwatch/eval_s")
    assert [s for s, _ in val] == [6] and [s for s, _ in ev] == list(range(7)) and ev[-1][1] > 0  # the tail's own


def test_tensorboard_finding_text_sits_at_each_findings_step(sw, tmp_path):
    """docs/sinks.md: the text summary ``stepwatch/findings`` at the finding's step. Findings of
    one background pass went into one text entry at the pass's last finding's step: a grad-norm
    spike at step 30 showed at step 39. One entry per step now."""
    stepwatch, mem, start = sw
    tb = tmp_path / "tb"
    start(records=False, tensorboard=str(tb), flush_interval_s=60)  # one pass, at shutdown
    torch.manual_seed(0)
    m = nn.Linear(8, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for i in range(40):
        loss = m(torch.randn(4, 8)).pow(2).mean()
        if i == 30:
            loss = loss * 1e4
        if i == 34:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        opt.step()
    stepwatch.shutdown()
    from stepwatch.exporters.tracking import finding_text

    spikes = [f for f in mem.findings if f.kind == "grad_norm_spike"]
    assert spikes[0].step == 30, mem.findings  # the episode's first; a closing "N in all" may follow
    assert all(f.data["episode"]["final"] and f.data["episode"]["first"] == 30 for f in spikes[1:]), spikes
    assert len({f.step for f in mem.findings}) >= 3, mem.findings  # nonfinite, a step-time spike
    acc, _ = _scalars(str(tb / "rank0"), "stepwatch/step_s")
    entries = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("stepwatch/findings/text_summary")]
    for f in mem.findings:
        assert {step for step, text in entries if finding_text(f) in text} == {f.step}, (f, entries)
    assert len(entries) == len({f.step for f in mem.findings}), entries


def test_tensorboard_writes_into_the_users_summary_writer_and_leaves_it_open(sw, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    stepwatch, mem, start = sw
    writer = SummaryWriter(log_dir=str(tmp_path / "mine"))
    start(records=False, tensorboard=writer)
    for i in range(3):
        writer.add_scalar("train/loss", 1.0 / (i + 1), i)
    _train(stepwatch, steps=10)
    stepwatch.shutdown()
    writer.add_scalar("train/loss", 0.1, 3)  # still the user's, still open
    writer.close()
    _, step_s = _scalars(str(tmp_path / "mine"), "stepwatch/step_s")
    assert [s for s, _ in step_s] == list(range(10))
    _, loss = _scalars(str(tmp_path / "mine"), "train/loss")
    assert len(loss) == 4


def test_closing_your_summary_writer_first_keeps_every_step_in_it(sw, tmp_path):
    """``writer.close()`` at the script's end, before stepwatch's shutdown (the usual order): the
    steps stepwatch had not written yet (a pass every second here) were lost, and the closed
    writer turned the sink off as an internal error. The close now first makes the pending
    step's record and waits until stepwatch has written the steps into the writer; what comes
    after the close (steps trained after it) is counted as dropped, not an error."""
    from torch.utils.tensorboard import SummaryWriter

    stepwatch, mem, start = sw
    writer = SummaryWriter(log_dir=str(tmp_path / "mine"))
    s = start(tensorboard=writer, flush_interval_s=1.0)
    _train_plain(10)
    writer.close()
    _train_plain(3)  # after the writer is closed: nowhere to go
    stepwatch.shutdown()
    _, step_s = _scalars(str(tmp_path / "mine"), "stepwatch/step_s")
    assert [st for st, _ in step_s] == list(range(10)), step_s
    manifest = json.loads(open(os.path.join(s.ctx.run_dir, "run.json")).read())
    assert manifest["internal_errors"] == {}, manifest
    assert manifest["exporter_drops"].get("tensorboard", {}).get("points") == 3, manifest["exporter_drops"]
    assert not [f for f in mem.findings if f.kind == "internal_error"]


def test_tensorboard_bad_argument_names_it(sw, tmp_path, monkeypatch):
    stepwatch, _, start = sw
    with pytest.raises(stepwatch.ConfigError, match="tensorboard=.*directory path or a SummaryWriter"):
        start(tensorboard=42)
    # A file where the directory goes: it failed at the first export, as an internal error with a
    # traceback through stepwatch.
    f = tmp_path / "afile"
    f.write_text("mine")
    with pytest.raises(stepwatch.ConfigError, match="tensorboard=.*is a file, not a directory"):
        start(tensorboard=str(f))
    monkeypatch.setenv("STEPWATCH_TENSORBOARD", str(f))
    with pytest.raises(stepwatch.ConfigError, match="STEPWATCH_TENSORBOARD=.*is a file, not a directory"):
        start()
    assert f.read_text() == "mine"


def test_a_sink_the_machine_refuses_gets_one_line_without_a_traceback(sw, tmp_path, caplog):
    """Its rank folder taken by a file (or a full disk, or no permission): an OSError is the
    machine's, not stepwatch's; it was logged as an internal error with a traceback through
    stepwatch. One line now, naming the sink and the reason; the job and the records go on."""
    import logging

    stepwatch, mem, start = sw
    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "rank0").write_text("a file where the rank's folder goes")
    logging.getLogger("stepwatch").addHandler(caplog.handler)
    try:
        start(tensorboard=str(tb))
        _train(None, 3)
        stepwatch.shutdown()
    finally:
        logging.getLogger("stepwatch").removeHandler(caplog.handler)
    said = [r for r in caplog.records if "tensorboard" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is None, [r.getMessage() for r in said]
    assert "rank0" in said[0].getMessage() and "internal error" not in said[0].getMessage()
    assert len(mem.records) == 3


# -- MLflow ------------------------------------------------------------------------------------


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """A local SQLite tracking store (MLflow >= 3.13 refuses the file store); artifacts under tmp."""
    _clean_env(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    import mlflow

    yield mlflow
    while mlflow.active_run() is not None:
        mlflow.end_run()


def test_mlflow_active_run_gets_one_step_s_per_step(sw, mlflow_store, tmp_path):
    mlflow = mlflow_store
    from mlflow import MlflowClient

    stepwatch, mem, start = sw
    with mlflow.start_run() as run:
        # Started before the run, as `import stepwatch.auto` at the top of a script is.
        start(records=False, window=10, data_wait_threshold_ms=1.0)
        mlflow.log_param("lr", 0.05)
        _train(stepwatch, slow_data_s=0.001)
        stepwatch.shutdown()
    rid = run.info.run_id
    client = MlflowClient()
    hist = client.get_metric_history(rid, "stepwatch/step_s")
    assert sorted(m.step for m in hist) == list(range(STEPS))
    want = {r.step: r.step_s for r in mem.records}
    assert all(abs(m.value - want[m.step]) < 1e-9 for m in hist)
    assert len(client.get_metric_history(rid, "stepwatch/scalars/loss")) == STEPS
    data = client.get_run(rid).data
    assert "stepwatch/data_wait_s" in data.metrics and data.params == {"lr": "0.05"}
    assert data.tags["stepwatch/run_dir"] == str(tmp_path / "run")
    assert data.tags["stepwatch/finding/data_loading"].startswith("warning: ")
    art = client.download_artifacts(rid, "stepwatch/findings.md", str(tmp_path / "dl"))
    assert "data_loading" in open(art, encoding="utf-8").read()


def test_mlflow_logs_each_step_into_the_run_active_when_it_ended(sw, mlflow_store):
    """A sweep in one process: run A, a stretch with no run, run B. Each run gets its own steps."""
    mlflow = mlflow_store
    from mlflow import MlflowClient

    stepwatch, mem, start = sw
    start(records=False)

    def hist(run):
        return sorted(m.step for m in MlflowClient().get_metric_history(run.info.run_id, "stepwatch/step_s"))

    def wait_for_a_pass():
        n = len(mem.records)
        deadline = time.monotonic() + 30
        while len(mem.records) == n and time.monotonic() < deadline:
            time.sleep(0.05)

    with mlflow.start_run() as a:
        _train_plain(10)  # steps 0-9
        wait_for_a_pass()
    _train_plain(10)  # steps 10-19, no run
    wait_for_a_pass()
    with mlflow.start_run() as b:
        _train_plain(10)  # steps 20-29
        stepwatch.shutdown()
    assert len(mem.records) == 30
    # A step's record is made at the next iteration's first fetch, after its run ended: the
    # last step of a stretch is still its run's (until the thirty-first session step 9 was
    # outside A, and step 19, trained with no run, went into B).
    assert hist(a) == list(range(10)), hist(a)
    assert hist(b) == list(range(20, 30)), hist(b)


def test_mlflow_with_block_gets_its_last_step_when_stepwatch_stops_after_it(sw, mlflow_store):
    """docs/sinks.md's pattern, ``with mlflow.start_run():`` around the loop, stepwatch stopping
    later (at exit): the last step's record is made after the run ended, and went nowhere."""
    mlflow = mlflow_store
    from mlflow import MlflowClient

    stepwatch, mem, start = sw
    start(records=False)
    with mlflow.start_run() as run:
        _train_plain(8)
    stepwatch.shutdown()
    hist = sorted(m.step for m in MlflowClient().get_metric_history(run.info.run_id, "stepwatch/step_s"))
    assert hist == list(range(8)), hist


def test_mlflow_failure_is_counted_and_turns_the_sink_off(sw, mlflow_store, tmp_path):
    """A run deleted under the job: MLflow refuses every write. One warning, one count in
    run.json, the sink off, every record still in the records file."""
    mlflow = mlflow_store
    from mlflow import MlflowClient

    stepwatch, mem, start = sw
    seen = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("stepwatch").addHandler(handler)
    try:
        with mlflow.start_run() as run:
            MlflowClient().delete_run(run.info.run_id)
            start()
            _train(stepwatch, steps=30)
            stepwatch.shutdown()
            MlflowClient().restore_run(run.info.run_id)  # so that the with-block can end it
    finally:
        logging.getLogger("stepwatch").removeHandler(handler)
    manifest = json.load(open(tmp_path / "run" / "run.json"))
    assert manifest["internal_errors"] == {"exporter.mlflow": 1}
    assert "mlflow" in manifest["exporters"]
    # Every step is counted as dropped, the failing batch's too (it went uncounted).
    assert manifest["exporter_drops"]["mlflow"] == {"points": 30}, manifest["exporter_drops"]
    assert len([m for m in seen if "mlflow" in m]) == 1, seen
    with open(tmp_path / "run" / "steps.rank0.jsonl") as f:
        assert len(f.readlines()) == 30
    assert len(mem.records) == 30


def test_mlflow_takes_every_name_a_user_logs_and_stays_on(sw, mlflow_store, tmp_path):
    """``stepwatch.log(**{"/loss": ...})``: the key ``stepwatch/scalars//loss`` is no normalized
    path, MLflow refused it, and the refusal turned the sink off for the rest of the run (10 of 20
    steps in MLflow). Each such name gets a key MLflow takes, apart from the others."""
    mlflow = mlflow_store
    from mlflow import MlflowClient

    stepwatch, mem, start = sw
    names = ["loss", "/loss", "loss/", "a//b", "", ".", "..", "./x", "a/../b"]  # the first to use a key holds it
    with mlflow.start_run() as run:
        start()
        _train_plain(20, lambda i: stepwatch.log(**{n: float(i + k) for k, n in enumerate(names)}))
        stepwatch.shutdown()
    manifest = json.load(open(tmp_path / "run" / "run.json"))
    assert not manifest["internal_errors"] and not manifest["exporter_drops"].get("mlflow"), manifest
    client = MlflowClient()
    keys = [k for k in client.get_run(run.info.run_id).data.metrics if k.startswith("stepwatch/scalars/")]
    assert len(keys) == len(names), keys
    got = {}
    for key in keys:
        hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert [s for s, _ in hist] == list(range(20)), (key, hist)
        got[hist[0][1]] = key  # step 0's value says which name it is
    assert sorted(got) == [float(k) for k in range(len(names))]
    assert got[0.0] == "stepwatch/scalars/loss"  # a plain name keeps its key (the others clean up to it: a CRC)


# -- W&B ---------------------------------------------------------------------------------------


def _wandb_rows(run_file):
    """History rows of an offline run file (a LevelDB-style log of protobuf records: 32 KiB
    blocks of [crc32, length, type] chunks behind a 7-byte ':W&B' header), and whether the run's
    exit record is in yet: wandb-core may still be writing the file when finish() returns."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, rows, buf, done = 7, 32768, [], b"", False
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left  # zero padding to the block's end
            continue
        if pos + 7 + length > len(data):
            break  # a chunk still being written: not parsed yet (the caller reads again)
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
            done = done or rec.WhichOneof("record_type") == "exit"
    return rows, done


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    yield wandb
    if wandb.run is not None:
        wandb.finish()


def test_wandb_offline_run_gets_summary_and_history(sw, wandb_offline, tmp_path):
    wandb = wandb_offline
    stepwatch, mem, start = sw
    start(records=False)
    run = wandb.init(project="stepwatch-test", mode="offline")
    # The user's own curve, logged without step= beside stepwatch's.
    _train(stepwatch, log_loss=lambda l: wandb.log({"train/loss": float(l)}))
    stepwatch.shutdown()
    assert "stepwatch/step_s" in run.summary.keys()
    last = max(mem.records, key=lambda r: r.step)
    assert run.summary["stepwatch/step"] == last.step == STEPS - 1
    assert abs(run.summary["stepwatch/step_s"] - last.step_s) < 1e-9
    run_dir = os.path.dirname(run.dir)
    run.finish()
    files = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    assert len(files) == 1
    deadline = time.monotonic() + 60
    rows, done = _wandb_rows(files[0])
    while not done and time.monotonic() < deadline:
        time.sleep(0.2)
        rows, done = _wandb_rows(files[0])
    assert done, "the offline run file never got its exit record"
    ours = [r for r in rows if "stepwatch/step_s" in r]
    missing = set(range(STEPS)) - {r["stepwatch/step"] for r in ours}
    assert len(ours) == STEPS and not missing, (missing, [r.get("_step") for r in rows])
    assert len([r for r in rows if "train/loss" in r]) == STEPS  # none of the user's rows lost
    steps = [r["_step"] for r in rows]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)


def _finished_rows(run_file):
    deadline = time.monotonic() + 60
    rows, done = _wandb_rows(run_file)
    while not done and time.monotonic() < deadline:
        time.sleep(0.2)
        rows, done = _wandb_rows(run_file)
    assert done, "the offline run file never got its exit record"
    return rows


def test_a_sweep_in_one_process_logs_each_runs_steps_into_it(sw, wandb_offline, tmp_path):
    """A sweep that runs several W&B runs in one process (``wandb.agent`` with a function; here
    three runs, each finished as its training ends): a run's last steps were still in
    stepwatch's queue when W&B finished it (a pass every 0.25 s), and went into the next run
    (the last run's were dropped). ``Run.finish`` on the training thread now makes the pending
    step's record and waits until the run's steps are logged into it; each step goes into the
    run it was trained in, and none is dropped."""
    wandb = wandb_offline
    stepwatch, mem, start = sw
    s = start(flush_interval_s=0.25)
    files = []
    for trial in range(3):
        run = wandb.init(project="stepwatch-test", mode="offline")
        _train_plain(10)  # steps 10 x trial ... 10 x trial + 9
        run_dir = os.path.dirname(run.dir)
        run.finish()
        files += glob.glob(os.path.join(run_dir, "run-*.wandb"))
    stepwatch.shutdown()
    assert len(files) == 3
    for trial, f in enumerate(files):
        ours = sorted(r["stepwatch/step"] for r in _finished_rows(f) if "stepwatch/step_s" in r)
        assert ours == list(range(10 * trial, 10 * trial + 10)), (trial, ours)
    manifest = json.loads(open(os.path.join(s.ctx.run_dir, "run.json")).read())
    assert manifest["exporter_drops"].get("wandb", {}).get("points", 0) == 0, manifest["exporter_drops"]
    assert manifest["features"]["wandb"] == {"run_seen": True, "off": False}


def test_a_with_block_run_gets_every_step_trained_in_it(sw, wandb_offline, tmp_path):
    """``with wandb.init(): train()`` (W&B's recommended form): the block's exit finishes the run
    through ``Run._finish``, not ``Run.finish``, so the wait for the run's last steps never ran
    and the steps still in stepwatch's queue (a pass every 0.25 s) were dropped."""
    wandb = wandb_offline
    stepwatch, mem, start = sw
    s = start(flush_interval_s=0.25)
    with wandb.init(project="stepwatch-test", mode="offline") as run:
        _train_plain(10)
        run_dir = os.path.dirname(run.dir)
    _train_plain(2)  # the script goes on after the run
    stepwatch.shutdown()
    (f,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    ours = sorted(r["stepwatch/step"] for r in _finished_rows(f) if "stepwatch/step_s" in r)
    assert ours == list(range(10)), ours
    manifest = json.loads(open(os.path.join(s.ctx.run_dir, "run.json")).read())
    # the two steps after the block had no run: counted, as before
    assert manifest["exporter_drops"].get("wandb", {}).get("points", 0) == 2, manifest["exporter_drops"]


def test_a_disabled_wandb_run_is_no_run_and_drops_nothing(sw, wandb_offline, tmp_path, caplog):
    """``wandb.init(mode="disabled")`` (``WANDB_MODE=disabled`` in CI, a debug run): its NoopRun was
    taken for a run, and every step was counted as dropped ("not in W&B") for a run the user had
    turned off."""
    wandb = wandb_offline
    stepwatch, mem, start = sw
    s = start()
    run = wandb.init(project="stepwatch-test", mode="disabled")
    with caplog.at_level(logging.INFO, logger="stepwatch"):
        _train_plain(10)
        run.finish()
        _train_plain(2)
        stepwatch.shutdown()
    manifest = json.loads(open(os.path.join(s.ctx.run_dir, "run.json")).read())
    assert manifest["exporter_drops"] == {}, manifest["exporter_drops"]
    assert manifest["features"]["wandb"] == {"run_seen": False, "off": False}
    assert not [r for r in caplog.records if "W&B" in r.getMessage()], caplog.text


def test_wandb_steps_after_the_run_finished_with_no_new_run_are_counted(sw, wandb_offline, tmp_path):
    """A sweep that finishes its W&B run and trains on (or ends) with no run: the records that
    came after were thrown away uncounted (``exporter_drops`` was empty while W&B lacked them)."""
    wandb = wandb_offline
    stepwatch, mem, start = sw
    s = start()
    wandb.init(project="stepwatch-test", mode="offline")
    _train_plain(10)
    deadline = time.monotonic() + 30
    while s.pipeline.steps_seen < 9 and time.monotonic() < deadline:
        time.sleep(0.05)  # the run is picked up by a pass, with the steps trained in it
    time.sleep(0.3)
    wandb.finish()
    s.pipeline.stop_thread()  # what follows reaches the sink with no run active
    _train_plain(5)
    stepwatch.shutdown()
    manifest = json.loads(open(os.path.join(s.ctx.run_dir, "run.json")).read())
    dropped = manifest["exporter_drops"].get("wandb", {}).get("points", 0)
    assert dropped >= 5, manifest["exporter_drops"]


def test_rows_are_sampled_above_the_rate_and_keep_the_newest():
    from stepwatch.exporters.tracking import RowLimiter

    now = [0.0]
    lim = RowLimiter(10, 5, clock=lambda: now[0])
    recs = list(range(20))
    assert lim.admit(recs) == [3, 7, 11, 15, 19]
    now[0] = 0.5  # 5 more tokens
    assert lim.admit(recs[:3]) == [0, 1, 2]
    assert lim.admit(recs[:3]) == [1, 2]  # 2 tokens left: the newest kept
    assert lim.sampled_out == 16


# -- all three at once -------------------------------------------------------------------------


def test_losses_unchanged_with_every_sink_on(sw, mlflow_store, tmp_path, monkeypatch):
    mlflow = mlflow_store
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    stepwatch, mem, start = sw
    without = _train(None)
    start(tensorboard=str(tmp_path / "tb"))
    run = wandb.init(project="stepwatch-test", mode="offline")
    try:
        with mlflow.start_run():
            with_all = _train(stepwatch)
            stepwatch.shutdown()
    finally:
        run.finish()
    assert with_all == without
    manifest = json.load(open(tmp_path / "run" / "run.json"))
    assert {"tensorboard", "wandb", "mlflow"} <= set(manifest["exporters"])
    assert manifest["internal_errors"] == {}


LAZY_SCRIPT = r"""
import sys
import stepwatch.auto
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def train(n):
    for _ in range(n):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
train(5)
loaded = [m for m in ("wandb", "mlflow", "torch.utils.tensorboard", "tensorboard") if m in sys.modules]
listeners = [getattr(fn, "__qualname__", "") for fn in stepwatch.get_session().tracker.listeners]
import mlflow  # the script starts using MLflow only now
with mlflow.start_run() as run:
    train(5)
    probing = [getattr(fn, "__qualname__", "") for fn in stepwatch.get_session().tracker.listeners]
    stepwatch.shutdown()
watches = [f for f in sys.meta_path if type(f).__module__.startswith("stepwatch")]
print(listeners, probing, watches)
print(loaded, run.info.run_id)
"""


def test_no_tracking_library_is_imported_until_the_script_uses_one(tmp_path):
    """In a fresh process (this test process has imported them all): the one-line import and 5
    steps import none of the libraries; MLflow imported later is picked up from then on."""
    import subprocess

    from mlflow import MlflowClient

    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPWATCH_", "MLFLOW_", "WANDB_"))}
    db = f"sqlite:///{tmp_path}/mlflow.db"
    env.update(PYTHONPATH=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src"),
               STEPWATCH_DIR=str(tmp_path / "run"), STEPWATCH_CONSOLE="off", MLFLOW_TRACKING_URI=db)
    r = subprocess.run([sys.executable, "-c", LAZY_SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded, rid = r.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert loaded == "[]", loaded
    # No MLflow call a step before the import (the probe joins the step-end listeners then), and
    # nothing of stepwatch's left on sys.meta_path.
    assert r.stdout.strip().splitlines()[-2] == "[] ['RunProbe.on_step_end'] []", r.stdout
    steps = sorted(m.step for m in MlflowClient(tracking_uri=db).get_metric_history(rid, "stepwatch/step_s"))
    assert steps[-5:] == list(range(5, 10)), steps


MLFLOW_EXIT_SCRIPT = """
import stepwatch.auto
import sys, torch
import mlflow
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with mlflow.start_run() as run:  # docs/sinks.md's pattern; stepwatch stops at exit, after it
    for _ in range(int(sys.argv[1])):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
print(run.info.run_id)
"""


@pytest.mark.parametrize("ended", ["by its with block", "by MLflow at exit"])
def test_mlflow_run_gets_its_last_step_when_stepwatch_stops_at_exit(tmp_path, ended):
    """No DataLoader, no shutdown of its own: the last step's record is made at exit, after the
    run ended (the with block, or MLflow's exit hook ending the run the script left open; it
    runs before stepwatch's). Its step went nowhere until the thirty-first session."""
    import subprocess

    from mlflow import MlflowClient

    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPWATCH_", "MLFLOW_", "WANDB_"))}
    db = f"sqlite:///{tmp_path}/mlflow.db"
    env.update(PYTHONPATH=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src"),
               STEPWATCH_DIR=str(tmp_path / "run"), STEPWATCH_CONSOLE="off", MLFLOW_TRACKING_URI=db)
    script = MLFLOW_EXIT_SCRIPT
    if ended == "by MLflow at exit":
        script = script.replace("with mlflow.start_run() as run:", "run = mlflow.start_run()\nif True:")
    r = subprocess.run([sys.executable, "-c", script, "6"], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rid = r.stdout.strip().splitlines()[-1]
    steps = sorted(m.step for m in MlflowClient(tracking_uri=db).get_metric_history(rid, "stepwatch/step_s"))
    assert steps == list(range(6)), steps


def test_import_watch_fires_once_after_the_first_import_and_leaves_sys_meta_path(tmp_path, monkeypatch):
    """The MLflow probe joins the step-end listeners, and the savers are patched, through
    ``_imports.ImportWatch`` when the script imports their module: its callback runs once the
    module has run (what it patches is there, and the importer binds the patched names), once
    per name; a module that fails to import calls nothing; a watch that never fired is taken
    off ``sys.meta_path`` at stop, one whose names were all seen takes itself off."""
    from stepwatch._imports import ImportWatch

    (tmp_path / "sw_watched_a.py").write_text("VALUE = 1\n")
    (tmp_path / "sw_watched_b.py").write_text("VALUE = 2\n")
    (tmp_path / "sw_watched_bad.py").write_text("raise ImportError('half installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []
    fired = ImportWatch(["sw_watched_a", "sw_watched_bad"],
                        lambda name: calls.append((name, getattr(sys.modules.get(name), "VALUE", None)))).start()
    never = ImportWatch(["sw_watched_b"], lambda name: calls.append(name)).start()
    try:
        with pytest.raises(ImportError, match="half installed"):
            import sw_watched_bad  # noqa: F401
        assert calls == [] and fired in sys.meta_path
        import sw_watched_a  # noqa: F401

        assert calls == [("sw_watched_a", 1)]  # after the module ran
        import importlib

        importlib.reload(sw_watched_a)
        assert calls == [("sw_watched_a", 1)]  # once
        assert never in sys.meta_path
        never.stop()
        assert never not in sys.meta_path
        import sw_watched_b  # noqa: F401

        assert len(calls) == 1 and sw_watched_b.VALUE == 2
        sys.modules.pop("sw_watched_bad", None)
        (tmp_path / "sw_watched_bad.py").write_text("VALUE = 3\n")
        importlib.invalidate_caches()
        import sw_watched_bad  # noqa: F401,F811

        assert calls == [("sw_watched_a", 1), ("sw_watched_bad", 3)]
        assert fired not in sys.meta_path  # all its names seen
    finally:
        fired.stop()
        never.stop()
        for name in ("sw_watched_a", "sw_watched_b", "sw_watched_bad"):
            sys.modules.pop(name, None)


def test_a_sink_that_fails_at_the_last_export_still_leaves_its_finding(sw, tmp_path):
    """A sink fails on its thread after the job's final pass was handed out (a short job, a
    shutdown): its internal_error finding was queued for a next pass that never came, so the
    records file said nothing of it (run.json counted it)."""
    import stepwatch

    stepwatch_mod, mem, start = sw

    class Broken(stepwatch.Exporter):
        name = "broken"

        def export(self, batch):
            raise RuntimeError("the tracking server refused the write")

    start(exporters=[Broken()], flush_interval_s=60)  # nothing exported before the shutdown
    _train(None, 2)
    stepwatch_mod.shutdown()
    run = tmp_path / "run"
    found = [json.loads(x) for x in (run / "findings.rank0.jsonl").read_text().splitlines()]
    assert [f["data"]["where"] for f in found if f["kind"] == "internal_error"] == ["exporter.broken"], found
    assert list(json.loads((run / "run.json").read_text())["internal_errors"]) == ["exporter.broken"]


WANDB_EXIT_SCRIPT = r"""
import sys, time
import stepwatch
stepwatch.init(dir=sys.argv[1], console="off", flush_interval_s=float(sys.argv[3]))
import torch, wandb
m = torch.nn.Linear(8, 1); opt = torch.optim.SGD(m.parameters(), lr=0.01)
def train(n):
    for i in range(n):
        m(torch.randn(4, 8)).pow(2).mean().backward(); opt.step(); opt.zero_grad(); time.sleep(0.01)
train(int(sys.argv[2]))  # before the W&B run: its records are not the run's
run = wandb.init(project="p", mode="offline")
print(run.dir, flush=True)
train(30)
if sys.argv[4:] == ["thread"]:  # finished on another thread (a helper of the script's): nothing waits
    import threading
    t = threading.Thread(target=run.finish)
    t.start()
    t.join()
# else no wandb.finish(): W&B finishes the run itself at exit, as most scripts let it
"""


def _wandb_exit_run(tmp_path, before, flush_interval_s, *more):
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPWATCH_", "WANDB_"))}
    env.update(PYTHONPATH=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "src"),
               WANDB_DIR=str(tmp_path), WANDB_SILENT="true", WANDB_MODE="offline")
    r = subprocess.run([sys.executable, "-c", WANDB_EXIT_SCRIPT, str(tmp_path / "run"), str(before),
                        str(flush_interval_s), *more], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    files = glob.glob(os.path.join(os.path.dirname(r.stdout.strip().splitlines()[-1]), "run-*.wandb"))
    assert len(files) == 1, files
    rows, done = _wandb_rows(files[0])
    assert done, "W&B did not finish the run at exit"
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    found = [json.loads(x) for x in (tmp_path / "run" / "findings.rank0.jsonl").read_text().splitlines()]
    return r.stderr, manifest, found, [row["stepwatch/step"] for row in rows if "stepwatch/step_s" in row]


def test_wandb_run_finished_by_wandb_at_exit_is_no_error(tmp_path):
    """A script that never calls wandb.finish(): W&B finishes the run in its own atexit hook,
    which runs before stepwatch's (registered earlier, at import), so stepwatch's last pass found
    the connection gone: "exporter.wandb cannot go on", an internal_error finding and a counted
    error on a clean run. Now the steps that came too late are dropped and counted, quietly."""
    err, manifest, found, steps = _wandb_exit_run(tmp_path, before=0, flush_interval_s=0.25)
    assert "cannot go on" not in err, err
    assert manifest["internal_errors"] == {}, manifest
    assert not [f for f in found if f["kind"] == "internal_error"], found
    assert manifest["ended_by"] == "shutdown"
    late = manifest["exporter_drops"].get("wandb", {}).get("points", 0)
    assert steps == list(range(len(steps))) and len(steps) + late == 30, (steps, manifest["exporter_drops"])


def test_wandb_run_finished_by_wandb_at_exit_gets_every_step(tmp_path):
    _, manifest, _, steps = _wandb_exit_run(tmp_path, before=0, flush_interval_s=0.25)
    assert steps == list(range(30)) and manifest["exporter_drops"] == {}, (steps, manifest["exporter_drops"])


def test_a_short_job_without_wandb_finish_gets_every_step_into_its_run(tmp_path):
    """No pass before the exit (a pass a minute; a short job ends before its first): the session's
    exit shutdown was put ahead of W&B's exit hook only when a pass first logged into the run, so
    W&B's hook finished the run first and every step was dropped. The run probe sees the run at
    the first step end on the training thread, and the shutdown goes ahead of W&B's hook then."""
    _, manifest, _, steps = _wandb_exit_run(tmp_path, before=3, flush_interval_s=60)
    assert steps == list(range(3, 33)) and manifest["exporter_drops"] == {}, (steps, manifest["exporter_drops"])


def test_wandb_run_that_was_finished_elsewhere_first_drops_the_rest_quietly(tmp_path, monkeypatch):
    """The run was finished on another thread (nothing waits there) before any pass logged into
    it (a pass a minute): stepwatch's records for it come after. They are dropped and counted,
    with one info line: no internal error, no finding."""
    err, manifest, found, steps = _wandb_exit_run(tmp_path, 3, 60, "thread")
    assert "cannot go on" not in err, err
    assert manifest["internal_errors"] == {}, manifest
    assert not [f for f in found if f["kind"] == "internal_error"], found
    lines = [x for x in err.splitlines() if "W&B" in x and "finished" in x]
    assert len(lines) == 1 and "INFO" in lines[0], err
    assert manifest["exporter_drops"].get("wandb", {}).get("points", 0) >= 1, manifest
    assert steps == [], steps

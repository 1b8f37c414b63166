"""``stepwatch bench-comm``'s arguments and its ``--json`` file: checked before anything is printed
or started (a bad --json path ran the whole sweep, then died with a traceback; -b > -e and -f 1
printed the table's header first); a file that cannot be written at the end is one line after the
table, not a traceback. Real single-rank gloo sweeps in this process (tiny sizes)."""

from __future__ import annotations

import json
import os
import socket

import pytest

from stepwatch.cli import main


@pytest.fixture
def one_rank(monkeypatch):
    """The environment torchrun gives a one-process job."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gloo on the CPU whatever the machine
    yield
    import torch.distributed as dist

    assert not dist.is_initialized()  # bench-comm's own group is destroyed, whatever happened


TINY = ["-b", "1K", "-e", "2K", "-n", "1", "-w", "0"]


def test_json_path_checked_before_the_sweep(one_rank, tmp_path, capsys):
    bad = str(tmp_path / "nonexist" / "x.json")
    assert main(["bench-comm", *TINY, "--json", bad]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing ran
    assert err == f"stepwatch bench-comm: --json {bad!r}: the directory {str(tmp_path / 'nonexist')!r} does not exist\n"
    assert main(["bench-comm", *TINY, "--json", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--json" in err and "is a directory" in err


@pytest.mark.parametrize("args, says", [
    (["-b", "2M", "-e", "1M"], "-e/--maxbytes (1048576) must be >= -b/--minbytes (2097152)"),
    (["-b", "1K", "-e", "2K", "-f", "1"], "-f/--stepfactor must be > 1, got 1.0"),
    (["-b", "1K", "-e", "2K", "-d", "int8"], "--dtype='int8'"),
])
def test_bad_sweep_arguments_print_nothing_but_the_error(one_rank, capsys, args, says):
    assert main(["bench-comm", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no table header before the error
    assert err.startswith("stepwatch bench-comm: ") and says in err and len(err.splitlines()) == 1, err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (writes fail: no space left)")
def test_json_write_failing_at_the_end_keeps_the_table_and_says_one_line(one_rank, capsys):
    """/dev/full passes the check (it is writable) and fails the write, as a filesystem that
    filled up during the sweep."""
    assert main(["bench-comm", *TINY, "--json", "/dev/full"]) == 1
    out, err = capsys.readouterr()
    rows = [ln for ln in out.splitlines() if not ln.startswith("#")]
    assert [int(r.split()[0]) for r in rows] == [1024, 2048]  # the results are on the screen
    assert "# Avg bus bandwidth" in out
    assert err == ("stepwatch bench-comm: --json '/dev/full': the results were not written (No space left on "
                   "device); the table above has them\n")


def test_json_written(one_rank, tmp_path, capsys):
    path = tmp_path / "x.json"
    assert main(["bench-comm", *TINY, "--json", str(path)]) == 0
    capsys.readouterr()
    assert [r["size"] for r in json.loads(path.read_text())["rows"]] == [1024, 2048]


@pytest.mark.parametrize("args, says", [
    (["-b", "inf"], "-b/--minbytes='inf' is not a size"),
    (["-e", "1e400"], "-e/--maxbytes='1e400' is not a size"),
    (["-b", "1K", "-e", "2K", "--backend", "foo"], "--backend='foo': expected nccl or gloo"),
    (["-b", "1K", "-e", "2K", "-f", "nan"], "-f/--stepfactor must be > 1, got nan"),
])
def test_arguments_torch_or_float_would_choke_on_are_one_line(one_rank, capsys, args, says):
    """``-b inf`` / ``-e 1e400`` were an OverflowError traceback (int(inf)); ``--backend foo``
    reached init_process_group and torch's AssertionError on every rank; ``-f nan`` passed the
    ``> 1`` check (nan compares false with everything)."""
    assert main(["bench-comm", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("stepwatch bench-comm: ") and says in err and len(err.splitlines()) == 1, err
    assert "Traceback" not in err


def test_a_fractional_stepfactor_measures_each_size_once(one_rank, capsys):
    """``-b 4 -e 32 -f 1.5``: 4, 6, 9, 13, 20, 30 bytes, rounded down to whole float32 elements
    measured 4, 4, 8, 12, 20, 28: the first size twice. Sizes strictly increase now."""
    from stepwatch.comm.bench import sizes

    assert main(["bench-comm", "-b", "4", "-e", "32", "-f", "1.5", "-n", "1", "-w", "0"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    assert [int(r.split()[0]) for r in rows] == [4, 8, 12, 20, 28]
    assert sizes(4, 32, 1.5, elem=4) == [4, 8, 12, 20, 28]
    assert sizes(1, 16, 1.1, elem=2) == [2, 4, 6, 8, 10, 12, 14]  # below one element: one element
    assert sizes(1024, 4096, 2) == [1024, 2048, 4096]


def test_a_stepfactor_too_close_to_one_is_refused_at_once(one_rank, capsys):
    """``-f 1.0000001`` from 1 B to 1 GB planned 2e8 steps of the size loop (minutes, no output)
    before the first row. It is one line naming -f and the least factor the range allows."""
    import time

    t0 = time.monotonic()
    assert main(["bench-comm", "-b", "1", "-e", "1G", "-f", "1.0000001"]) == 2
    assert time.monotonic() - t0 < 5.0
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert "-f/--stepfactor 1.0000001 is too close to 1" in err and "use -f 1.000208" in err, err
    assert main(["bench-comm", "-b", "1K", "-e", "2K", "-f", "1.001"]) == 0  # a fine sweep still runs
    rows = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    assert len(rows) == 256, len(rows)  # every whole float32 count from 1 KiB to 2 KiB, each once

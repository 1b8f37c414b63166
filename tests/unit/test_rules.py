"""`stepwatch rules` / `stepwatch dashboard`: the files they write pass `promtool check rules` and
`promtool test rules` (Debian's prometheus package, installed by scripts/install_prometheus.sh),
every alert has firing and non-firing input, and the reference sheet's broken expressions fail
the same tests (so the tests can tell right from wrong)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess

import pytest

from stepwatch.cli import main
from stepwatch.rules import _yaml, alerts, dashboard, proofs, queries

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def promtool():
    if shutil.which("promtool") is None:
        r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install_prometheus.sh")], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            pytest.fail(f"scripts/install_prometheus.sh failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    path = shutil.which("promtool")
    assert path, "promtool missing after scripts/install_prometheus.sh"
    return path


def _write_and_test(tmp_path, promtool, al):
    rules = tmp_path / "rules.yml"
    tests = tmp_path / "rules_test.yml"
    rules.write_text(_yaml.dump(alerts.rules_doc(al)))
    tests.write_text(_yaml.dump(alerts.tests_doc(al, "rules.yml")))
    check = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    test = subprocess.run([promtool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    return check, test


def test_cli_writes_rules_that_promtool_checks_and_tests(tmp_path, promtool):
    out, tst = tmp_path / "r" / "stepwatch.rules.yml", tmp_path / "t" / "stepwatch.rules_test.yml"
    assert main(["rules", "-o", str(out), "--tests", str(tst)]) == 0
    r = subprocess.run([promtool, "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alerts.build())} rules found" in r.stdout
    # rule_files is relative to the test file, as promtool resolves it.
    r = subprocess.run([promtool, "test", "rules", str(tst)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_firing_and_quiet_series():
    al = alerts.build()
    assert len({a.name for a in al}) == len(al)
    assert {a.group for a in al} == {"stepwatch-training", "stepwatch-gpu", "stepwatch-serving"}
    for a in al:
        assert a.case.firing, a.name
        # At least one input series whose labels match no firing alert: the non-firing case.
        quiet = [s for s, _ in a.case.series if not any(all(f'{k}="{v}"' in s for k, v in lab.items()) for lab in a.case.firing)]
        assert quiet, f"{a.name} has no non-firing input series"


def test_corrections_to_the_reference_sheet_are_in_the_rules():
    by = {a.name: a for a in alerts.build()}
    assert by["TrainingMFUDrop"].expr == "training_mfu offset 10m - training_mfu > 0.05"
    assert by["GPUSMUnderutilized"].expr == "DCGM_FI_PROF_SM_ACTIVE < 0.5"
    assert "stepwatch_gpu_clocks_event_active" in by["GPUThermalThrottle"].expr
    assert "gpu_idle" not in by["GPUThermalThrottle"].expr
    assert "vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc" in by["VLLMKVCacheCascadeRisk"].expr
    assert "or rate(vllm:time_per_output_token_seconds_bucket" in by["VLLMInterTokenLatencyHigh"].expr
    assert by["TrainingStalled"].expr == "rate(training_steps_total[2m]) == 0"
    assert not any("request_count_total" in a.expr for a in by.values())


@pytest.mark.parametrize(
    "name, reference_expr",
    [
        ("TrainingMFUDrop", "training_mfu - training_mfu offset 10m > 0.05"),  # fires on a rise
        ("GPUSMUnderutilized", "DCGM_FI_PROF_SM_ACTIVE < 50"),  # percent against a 0-1 ratio
        ("GPUThermalThrottle", 'max by (Hostname, gpu) (stepwatch_gpu_clocks_event_active) > 0'),  # counts "GPU idle"
        ("VLLMKVCacheCascadeRisk", "vllm:kv_cache_usage_perc > 0.82"),  # no fallback to the old name
    ],
)
def test_reference_sheet_versions_fail_the_shipped_tests(tmp_path, promtool, name, reference_expr):
    al = [a for a in alerts.build() if a.name == name]
    check, test = _write_and_test(tmp_path, promtool, al)
    assert check.returncode == 0, check.stdout + check.stderr
    assert test.returncode == 0, test.stdout + test.stderr  # ours passes...
    bad = [dataclasses.replace(al[0], expr=reference_expr)]
    check, test = _write_and_test(tmp_path, promtool, bad)
    assert test.returncode != 0 and name in test.stdout + test.stderr  # ...the sheet's does not


def test_dashboard_runs_exactly_the_proven_queries(tmp_path):
    out = tmp_path / "dash.json"
    assert main(["dashboard", "-o", str(out)]) == 0
    d = json.loads(out.read_text())
    exprs = dashboard.queries_in(d)
    assert exprs == [q.expr for q in queries.ALL]
    assert set(proofs.EXPECTED) == {q.key for q in queries.ALL}
    titles = " ".join(p["title"] for p in d["panels"])
    for word in ("P50", "P99", "MFU", "Gradient norm", "Data wait", "overlapped", "Exposed comm", "bus bandwidth",
                 "Straggler", "SM active", "TTFT", "KV cache"):
        assert word in titles, word
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))


def test_rules_cli_bad_input_names_the_argument(capsys):
    assert main(["rules", "--tests", "t.yml"]) == 2
    assert "--tests needs -o FILE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["rules", "--ttft-p99-slo", "-1"])
    assert "--ttft-p99-slo" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["inf", "1e400", "nan", "0"])
def test_an_slo_that_can_never_be_crossed_is_refused(capsys, value):
    """``--ttft-p99-slo inf`` wrote ``... > inf``: an alert that can never fire (its own promtool
    test failed). Every SLO is a finite number above 0."""
    with pytest.raises(SystemExit):
        main(["rules", "--ttft-p99-slo", value])
    err = capsys.readouterr().err
    assert "--ttft-p99-slo" in err and "finite number > 0" in err, err


@pytest.mark.parametrize("args, says", [
    (["--uid", "my dash/board"], "--uid"),
    (["--uid", "x" * 41], "--uid"),
    (["--uid", ""], "--uid"),
    (["--title", ""], "--title"),
    (["--title", "   "], "--title"),
])
def test_a_dashboard_grafana_would_refuse_is_not_written(tmp_path, capsys, args, says):
    """Grafana takes a uid of at most 40 characters of letters, digits, '-' and '_', and a title
    that is not empty: either written as given made a file Grafana refused, exit 0."""
    out = tmp_path / "d.json"
    with pytest.raises(SystemExit) as e:
        main(["dashboard", "-o", str(out), *args])
    assert e.value.code == 2 and not out.exists()
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["rules", "dashboard"])
def test_an_output_that_cannot_be_written_is_one_line_naming_it(tmp_path, capsys, cmd):
    """``-o`` a directory (or below a file) raised IsADirectoryError's traceback."""
    assert main([cmd, "-o", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"stepwatch {cmd}: error: cannot write {str(tmp_path)!r}" in err and "-o FILE" in err
    assert "Traceback" not in err
    (tmp_path / "f").write_text("")
    assert main([cmd, "-o", str(tmp_path / "f" / "x.yml")]) == 1
    # below a file: said so ("File exists" named no file)
    assert f"{str(tmp_path / 'f')!r} is a file, not a folder" in capsys.readouterr().err
    assert main([cmd, "-o", str(tmp_path / "f" / "deeper" / "x.yml")]) == 1
    assert f"{str(tmp_path / 'f')!r} is a file, not a folder" in capsys.readouterr().err
    if cmd == "rules":
        assert main([cmd, "-o", str(tmp_path / "r.yml"), "--tests", str(tmp_path)]) == 1
        assert "--tests FILE" in capsys.readouterr().err


def test_yaml_writer_quotes_promql_safely():
    text = _yaml.dump({"a": [{"expr": 'x{a="b"} > 0 # not a comment', "n": 1.5, "e": []}], "b": {}})
    assert '"x{a=\\"b\\"} > 0 # not a comment"' in text
    assert "n: 1.5" in text and "e: []" in text and "b: {}" in text


def test_docs_list_every_alert():
    doc = open(os.path.join(ROOT, "docs", "metrics.md"), encoding="utf-8").read()
    missing = [a.name for a in alerts.build() if f"`{a.name}`" not in doc]
    assert not missing, f"docs/metrics.md does not list: {missing}"


@pytest.mark.parametrize("args", [
    ["--ttft-p99-slo", "0.5"], ["--ttft-p99-slo", "5"], ["--ttft-p99-slo", "1.23456789"],
    ["--itl-p99-slo", "0.6"], ["--itl-p99-slo", "0.01"], ["--itl-p99-slo", "0.123456789"],
    ["--ttft-p99-slo", "30", "--itl-p99-slo", "2"],
])
def test_the_test_file_follows_the_slos_given(tmp_path, promtool, args):
    """The serving cases' histograms were fixed for the default SLOs (TTFT P99 4.92 s against
    0.99 s, ITL 0.495 s against 0.0495 s): ``--ttft-p99-slo 0.5`` made the quiet model fire,
    ``--ttft-p99-slo 5`` the firing one quiet, and stepwatch's own test file failed promtool."""
    out, tst = tmp_path / "r.yml", tmp_path / "t.yml"
    assert main(["rules", *args, "-o", str(out), "--tests", str(tst)]) == 0
    r = subprocess.run([promtool, "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([promtool, "test", "rules", str(tst)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name, slo, other", [
    ("VLLMTTFTP99High", "ttft_p99_s", 4.0), ("VLLMTTFTP99High", "ttft_p99_s", 1.0),
    ("VLLMInterTokenLatencyHigh", "itl_p99_s", 0.2), ("VLLMInterTokenLatencyHigh", "itl_p99_s", 0.05),
])
def test_the_slo_cases_tell_the_threshold_given_from_another(tmp_path, promtool, name, slo, other):
    """The cases follow the SLO and still discriminate: the rule written for an SLO twice (or half)
    the one the test data was made for fails that data (fires on the quiet model, or not at all);
    the data made for the default SLOs let a rule at twice the SLO pass."""
    t = alerts.Thresholds()
    al = [a for a in alerts.build(t) if a.name == name]
    check, test = _write_and_test(tmp_path, promtool, al)
    assert check.returncode == 0 and test.returncode == 0, test.stdout + test.stderr
    # the other SLO's expression, with this SLO's data and annotations
    other_expr = next(a.expr for a in alerts.build(dataclasses.replace(t, **{slo: other})) if a.name == name)
    assert other_expr != al[0].expr
    check, test = _write_and_test(tmp_path, promtool, [dataclasses.replace(al[0], expr=other_expr)])
    assert test.returncode != 0 and name in test.stdout + test.stderr, test.stdout + test.stderr


def test_rules_and_tests_naming_the_same_file_are_refused(tmp_path, monkeypatch, capsys):
    """``-o F --tests F`` wrote the test file over the rules, exit 0 without a word. Compared as
    resolved paths: another spelling or a symlink of the same file is the same file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    os.symlink("same.yml", tmp_path / "link.yml")
    for o, t in (("same.yml", "same.yml"), ("same.yml", "./sub/../same.yml"), ("same.yml", str(tmp_path / "link.yml"))):
        assert main(["rules", "-o", o, "--tests", t]) == 2, (o, t)
        err = capsys.readouterr().err
        assert err == (f"stepwatch rules: -o FILE and --tests FILE are the same file ({str(tmp_path / 'same.yml')!r}): "
                       "the tests would overwrite the rules; give the test file another name\n"), err
        assert not (tmp_path / "same.yml").exists()  # nothing written
    (tmp_path / "same.yml").write_text("groups: []\n")  # rules from an earlier run: kept as they were
    assert main(["rules", "-o", "same.yml", "--tests", "same.yml"]) == 2
    assert (tmp_path / "same.yml").read_text() == "groups: []\n"
    assert main(["rules", "-o", "same.yml", "--tests", "same_test.yml"]) == 0  # another name: both written
    assert (tmp_path / "same.yml").read_text().count("alert:") == len(alerts.build())
    assert '"same.yml"' in (tmp_path / "same_test.yml").read_text()


def test_slo_thresholds_are_written_exactly(tmp_path):
    """``--ttft-p99-slo 1.23456789`` wrote ``> 1.23457`` (``:g`` keeps 6 significant digits)."""
    out = tmp_path / "r.yml"
    assert main(["rules", "--ttft-p99-slo", "1.23456789", "--itl-p99-slo", "0.123456789", "-o", str(out)]) == 0
    by = {a.name: a for a in alerts.build(alerts.Thresholds(ttft_p99_s=1.23456789, itl_p99_s=0.123456789))}
    assert by["VLLMTTFTP99High"].expr.endswith(") > 1.23456789")
    assert by["VLLMInterTokenLatencyHigh"].expr.endswith(") > 0.123456789")
    assert by["VLLMTTFTP99High"].summary.startswith("TTFT P99 above 1.23456789 s on ")
    assert by["VLLMInterTokenLatencyHigh"].summary.startswith("Inter-token latency P99 above 123.456789 ms on ")
    text = out.read_text()
    assert '> 1.23456789"' in text and '> 0.123456789"' in text
    # the defaults read as before
    by = {a.name: a for a in alerts.build()}
    assert by["VLLMTTFTP99High"].expr.endswith(") > 2") and "above 2 s" in by["VLLMTTFTP99High"].summary
    assert by["VLLMInterTokenLatencyHigh"].expr.endswith(") > 0.1") and "above 100 ms" in by["VLLMInterTokenLatencyHigh"].summary

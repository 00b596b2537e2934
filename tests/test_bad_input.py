"""Bad input gets one line naming what was wrong and where, and exit code 2: never a traceback,
never a hang. Each case below was once a traceback (exit 1) or a hang; the fuzz tests then
throw random documents at every reader of user input."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.config import check_config, parse_listen
from agent.errors import ConfigError
from agent.ledger.report import parse_time
from agent.ledger.store import Ledger
from agent.units import parse_duration, parse_size_bytes
from agent.yamlfile import YamlFileError, read_yaml
from exporters.webconfig import load_web_config
from fake_nvml.scenario import ScenarioError, load_scenario
from tests.test_cli import gpuledger

HUGE = "1" * 400

CONFIG_CASES = [
    # (config text, what the one line must name)
    ("listen: 9835\n", "listen"),
    ("1: 2\n", "keys must be text"),
    ("rules: {idle: {yes: 1}}\n", "rules.idle"),
    ("poll_interval: .inf\n", "poll_interval"),
    ("ledger: {retention: .inf}\n", "ledger.retention"),
    (f"rules: {{stranded_memory: {{memory_above: {HUGE}}}}}\n", "rules.stranded_memory.memory_above"),
    ('listen: "127.0.0.1:\u00b2"\n', "listen"),
    ("accounting: {max_interval: 99999999999999999999999d}\n", "accounting.max_interval"),
    # A custom underused rule without a window took its mean over no time: it never held, unsaid.
    (
        "rules: {custom: [{name: low_use, condition: underused, utilization_below: 0.2, for: 30m}]}\n",
        "rules.custom.0.window: an underused rule takes its mean over a window",
    ),
    # A unit slip polled the driver (or wrote the ledger, asked the kubelet, waited on events)
    # without pause.
    ("poll_interval: 0.0000001s\n", "poll_interval: Input should be greater than or equal to 0.1"),
    ("ledger: {flush_interval: 1ms}\n", "ledger.flush_interval"),
    ("attribution: {kubelet_interval: 1ms}\n", "attribution.kubelet_interval"),
    ("events: {wait: 0.0001s}\n", "events.wait"),
    ("events: {retry: 1ms}\n", "events.retry"),
    # Every driver call outlasted it: every GPU read as down, all its time unobserved.
    ("watchdog: {call_timeout: 0.000001s}\n", "watchdog.call_timeout"),
    # Meant as days, 400 is seconds: every hour of the ledger but the current one was deleted.
    ("ledger: {retention: 400}\n", "ledger.retention: at least 1d, got 6m40s"),
    # Taken as it was: a label value, ledger key and GPULEDGER_NODE with a NUL or an escape in it.
    ('node_name: "gpu\\0-01\\e[2J"\n', "node_name: holds a control character (gpu\\x00-01\\x1b[2J)"),
    # check-config printed an action's program as the file spells it, an escape sequence with it.
    (
        'actions: {triggers: {x: {flag: idle, scope: gpu, command: ["/no/such\\e[2J"]}}}\n',
        "actions.triggers.x.command: /no/such\\x1b[2J: no such executable file",
    ),
    # A second section of one name replaced the first whole: its prices were dropped unsaid.
    (
        "pricing: {gpu_hourly: 2.5}\npoll_interval: 5s\npricing: {energy_per_kwh: 0.1}\n",
        "line 3: duplicate key 'pricing'",
    ),
]


@pytest.mark.parametrize(("text", "names"), CONFIG_CASES)
def test_check_config_and_run_refuse_the_same_bad_file_in_one_line(tmp_path: Path, text: str, names: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    for args in (("check-config", str(config)), ("run", "--fake", "--config", str(config))):
        result = gpuledger(*args, timeout=20)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert names in lines[0]
        assert "Traceback" not in result.stderr


ARGUMENT_CASES = [
    (("run", "--fake", "--fake-speed", "nan"), "--fake-speed"),
    (("run", "--fake", "--fake-speed", "inf"), "--fake-speed"),
    (("run", "--fake", "--listen", "127.0.0.1:\u00b2"), "--listen"),
    (("snapshot", "--fake", "--at", "9" * 40 + "d"), "--at"),
    (("report", "--ledger", "pyproject.toml", "--since", "99999999d"), "100 years"),
    (("report", "--ledger", "pyproject.toml", "--until", "9999-12-31T23:59:59"), "out of range"),
    # A file that is not a ledger is bad input (it was exit 1), and a path with control characters
    # in it is quoted escaped, not written to the terminal.
    (("report", "--ledger", "pyproject.toml"), "ledger pyproject.toml: is not a ledger (not an SQLite database)"),
    (("report", "--ledger", "/dev/null"), "ledger /dev/null: is not a regular file"),  # it said "no such file"
    (("report", "--ledger", "pyproject.toml", "--since", "2026-13-45"), "gpuledger: --since: expected a time"),
    # An empty time was read as no bound at all: the whole ledger, silently.
    (("report", "--ledger", "pyproject.toml", "--since", ""), "gpuledger: --since: expected a time"),
    (("export", "--ledger", "pyproject.toml", "--until", ""), "gpuledger: --until: expected a time"),
    # An empty --ledger was the working directory: its *.db files, whatever they were, were read.
    (("report", "--ledger", ""), "gpuledger: --ledger: an empty path names no ledger file"),
    (("report", "--ledger", "a\x1b[31mb.db"), "no such ledger file a\\x1b[31mb.db"),
    # 2.6 billion polls were accepted and would have run for days; a fake node faster than a year
    # a minute overflowed the clock at every poll, with a traceback each.
    (("simulate", "demo", "--for", "30d", "--step", "1ms"), "2,592,000,000 polls; at most 6,307,200"),
    (("run", "--fake", "--fake-speed", "1e15"), "--fake-speed: at most 525,600 (a year a minute)"),
    # A directory as --metrics-out failed with exit 1 after the whole simulation ran.
    (("simulate", "demo", "--for", "10m", "--metrics-out", "/tmp"), "--metrics-out: /tmp is a directory"),
    # The label went into the store's matchers as given: a matcher of its own, or a parse error
    # only once a counter fell.
    (
        ("report", "--prometheus", "http://127.0.0.1:9", "--node-label", 'instance=~".*",x'),
        """gpuledger: --node-label: 'instance=~".*",x' is not a label name""",
    ),
    # The Slurm account is no metric label: the store's rows were all grouped under an empty one.
    (
        ("report", "--prometheus", "http://127.0.0.1:9", "--by", "team,account"),
        "gpuledger: report: --by account reads ledgers, not a --prometheus store",
    ),
]


@pytest.mark.parametrize(("args", "names"), ARGUMENT_CASES)
def test_bad_arguments_exit_2_in_one_line(args: tuple[str, ...], names: str) -> None:
    result = gpuledger(*args, timeout=20)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert names in lines[0]


def test_a_section_variable_that_is_not_json_is_named() -> None:
    result = gpuledger("check-config", "/dev/null", env={"GPULEDGER_PRICING": "notjson"}, timeout=20)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "environment: GPULEDGER_PRICING: not a JSON object (or set its keys as GPULEDGER_PRICING__KEY)"
    )


def test_a_key_variable_that_is_not_json_is_named_not_its_section() -> None:
    # It named GPULEDGER_PRICING, which was not set.
    result = gpuledger("check-config", "/dev/null", env={"GPULEDGER_PRICING__BY_MODEL": "notjson"}, timeout=20)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "environment: GPULEDGER_PRICING__BY_MODEL: not JSON (a mapping or list is given as JSON)"
    )


def test_a_variable_whose_bytes_are_not_utf8_is_named_before_anything_is_written(tmp_path: Path) -> None:
    # Python hands undecodable bytes on as lone surrogates: the node name reached the ledger's
    # first query, which failed with a UnicodeEncodeError traceback (exit 1).
    ledger = tmp_path / "ledger.db"
    env = {"GPULEDGER_NODE_NAME": b"gpu\xffnode".decode(errors="surrogateescape")}
    result = gpuledger("simulate", "demo", "--for", "2m", "--ledger", str(ledger), env=env, timeout=60)
    assert (result.returncode, result.stderr.strip()) == (
        2,
        "environment: node_name (from GPULEDGER_NODE_NAME): not UTF-8 text",
    )
    assert not ledger.exists()


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        # An infinite price passed, and then every charge was refused as not finite: exit 0, an
        # empty ledger. A mistyped exponent overflowed the dollars it multiplied.
        ("pricing: {gpu_hourly: .inf}", "pricing.gpu_hourly: Input should be a finite number"),
        ("pricing: {energy_per_kwh: .nan}", "pricing.energy_per_kwh: Input should be a finite number"),
        (
            "pricing: {by_model: {A100-SXM4-80GB: 1e308}}",
            "pricing.by_model.A100-SXM4-80GB: Input should be less than or equal to 1000000",
        ),
        ("pricing: {instance_hourly: {p4d.24xlarge: -1}}", "Input should be greater than or equal to 0"),
        # YAML's yes/on is true, which passed as 1: $1/GPU-hour, a 100% threshold.
        ("pricing: {gpu_hourly: yes}", "pricing.gpu_hourly: expected a number, got True"),
        ("pricing: {by_model: {H100-SXM5-80GB: on}}", "pricing.by_model.H100-SXM5-80GB: expected a number, got True"),
        ("rules: {idle: {utilization_below: on}}", "rules.idle.utilization_below: expected a number, got True"),
    ],
)
def test_a_price_that_is_not_a_finite_sane_number_is_refused(tmp_path: Path, document: str, problem: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(document + "\n")
    settings_, problems = check_config(config)
    assert settings_ is None
    assert len(problems) == 1
    assert problems[0].startswith(f"{config}: ")
    assert problem in problems[0]


def test_yaml_that_would_hang_or_overflow_a_reader_is_one_line(tmp_path: Path) -> None:
    # Nine levels of anchors, each alias used nine times: 9^9 values once expanded, which the
    # key check (and then the loader) walked for ever. Nesting 5,000 deep overflowed the stack.
    # A FIFO or a device is read until it ends: never.
    laughs = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for before, name in zip("abcdefgh", "bcdefghi", strict=True):
        laughs.append(f"{name}: &{name} [" + ", ".join([f"*{before}"] * 9) + "]")
    files = {
        "laughs.yaml": "\n".join(laughs) + "\n",
        "deep.yaml": "x: " + "[" * 5000 + "]" * 5000 + "\n",
        # An alias inside its own anchor's value: a mapping that holds itself, sized for ever.
        "itself.yaml": "pricing: &p {by_model: {H100-SXM5-80GB: 4.0}, more: [*p]}\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    os.mkfifo(tmp_path / "fifo.yaml")
    expected = {
        "laughs.yaml": "holds more than 2,000,000 values once its aliases are expanded; a settings or scenario "
        "file is far smaller",
        "deep.yaml": "nested too deeply",
        "itself.yaml": "an alias stands inside its own anchor's value, which would never end",
        "fifo.yaml": "not a regular file, not a config file",
    }
    for name, problem in expected.items():
        result = gpuledger("check-config", str(tmp_path / name), timeout=20)
        assert (result.returncode, result.stderr.strip()) == (2, f"{tmp_path / name}: {problem}")
    result = gpuledger("simulate", str(tmp_path / "laughs.yaml"), "--for", "1m", timeout=20)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(f"gpuledger: scenario {tmp_path / 'laughs.yaml'}: holds more than")


def test_run_refuses_a_ledger_path_that_can_never_hold_a_ledger(tmp_path: Path) -> None:
    # It used to start, keep every charge in memory while retrying, and lose them all at the stop.
    # A ledger whose first bytes were overwritten while the agent was down is such a file too
    # (never moved aside: it may be someone else's); the agent says so and leaves it alone.
    garbage = tmp_path / "notes.db"
    garbage.write_text("my notes\n")
    os.mkfifo(tmp_path / "pipe.db")
    garbled = tmp_path / "garbled.db"
    Ledger(garbled, node="n1", retention_s=None).close()
    with garbled.open("r+b") as f:
        f.write(b"\xa5" * 100)
    before = garbled.read_bytes()
    cases = (
        (garbage, "is not a ledger (not an SQLite database)"),
        (tmp_path / "pipe.db", "is not a regular file"),
        (garbled, "is not a ledger (not an SQLite database)"),
    )
    for path, why in cases:
        result = gpuledger("run", "--fake", "--listen", "127.0.0.1:0", "--ledger", str(path), timeout=30)
        assert result.returncode == 2
        assert result.stderr.strip().splitlines()[-1] == f"gpuledger: ledger {path}: {why}"
    assert garbage.read_text() == "my notes\n"
    assert garbled.read_bytes() == before


def test_a_reader_that_goes_away_is_no_error(tmp_path: Path) -> None:
    # `gpuledger snapshot --fake | head -1`: the pipe closes before gpuledger writes. It used
    # to end with "gpuledger: Broken pipe" on stderr, an error that is not one; now it stops
    # quietly, as cat does (exit 1: it did not write everything).
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "agent", "snapshot", "--fake"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 1
    assert "Broken pipe" not in result.stderr
    assert "Traceback" not in result.stderr
    assert "Exception ignored" not in result.stderr


# -- fuzzing: every reader of user input fails with its own one-line error, or succeeds --------

keys = st.one_of(
    st.sampled_from(
        [
            "listen",
            "poll_interval",
            "pricing",
            "ledger",
            "rules",
            "idle",
            "for",
            "retention",
            "gpu_hourly",
            "memory_above",
            "exporters",
            "textfile_path",
            "attribution",
            "env_allowlist",
            "match",
            "set",
        ]
    ),
    st.text(max_size=8),
    st.integers(),
    st.booleans(),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["30s", "1h30m", ".inf", "nan", "1GiB", "0.0.0.0:9835", "9" * 50 + "d", ":99999"]),
)
documents = st.recursive(scalars, lambda inner: st.dictionaries(keys, inner, max_size=4) | st.lists(inner, max_size=3))


def _write(tmp_path: Path, name: str, document: object) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(document, allow_unicode=True))
    return path


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=st.dictionaries(keys, documents, max_size=5))
def test_any_config_document_gives_settings_or_one_line_problems(tmp_path: Path, document: object) -> None:
    settings_, problems = check_config(_write(tmp_path, "config.yaml", document))
    assert (settings_ is None) == bool(problems)
    for line in problems:
        assert "\n" not in line
        assert line.startswith(str(tmp_path))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=documents)
def test_any_web_config_document_loads_or_raises_a_config_error(tmp_path: Path, document: object) -> None:
    try:
        load_web_config(_write(tmp_path, "web.yaml", document))
    except ConfigError as exc:
        message = str(exc)
    else:
        return
    assert "\n" not in message


@settings(max_examples=150, deadline=None)
@given(document=st.dictionaries(st.sampled_from(["start", "node", "gpus", "processes", "allocations", "faults"]),
                                documents, max_size=4))  # fmt: skip
def test_any_scenario_document_loads_or_raises_a_scenario_error(document: dict[str, object]) -> None:
    try:
        load_scenario(document)
    except ScenarioError as exc:
        message = str(exc)
    else:
        return
    assert "\n" not in message


@given(st.one_of(scalars, st.text(alphabet="0123456789.smhdw", max_size=30)))
def test_durations_parse_to_finite_bounded_seconds_or_value_error(value: object) -> None:
    try:
        seconds = parse_duration(value)
    except ValueError:
        return
    assert math.isfinite(seconds)
    assert 0 <= seconds <= 100 * 365.25 * 86400


@given(scalars)
def test_sizes_parse_to_bounded_bytes_or_value_error(value: object) -> None:
    try:
        size = parse_size_bytes(value)
    except ValueError:
        return
    assert 0 <= size <= 2**60


@given(st.text(max_size=30))
def test_listen_addresses_parse_to_a_port_or_value_error(value: str) -> None:
    try:
        _host, port = parse_listen(value)
    except ValueError:
        return
    assert 0 < port < 65536


@given(st.one_of(st.text(max_size=30), st.text(alphabet="0123456789-T:+Zdhmsw.", max_size=30)))
def test_report_times_parse_into_range_or_value_error(value: str) -> None:
    try:
        t = parse_time(value, now=1_800_000_000.0)
    except ValueError:
        return
    assert 0 <= t < 221_845_392_000  # 9000-01-01T00:00Z: the end of the range parse_time allows


# -- check-config checks what run checks ----------------------------------------------------


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ("exporters: {textfile_path: NOWHERE/gpuledger.prom}\n", "exporters.textfile_path: no such directory"),
        ("web_config_file: NOWHERE/web.yaml\n", "missing/web.yaml: no such web config file"),
        ("ledger: {path: TMP}\n", "ledger.path: TMP is a directory, not a file"),
        ("ledger: {path: FILE/ledger.db}\n", "ledger.path: FILE is not a directory"),
        # Its read at start-up waited for a writer for good.
        ("actions: {state_file: FIFO}\n", "actions.state_file: FIFO is not a regular file"),
    ],
)
def test_check_config_refuses_what_run_refuses(tmp_path: Path, config: str, problem: str) -> None:
    (tmp_path / "file").write_text("")
    os.mkfifo(tmp_path / "fifo")
    text = config.replace("NOWHERE", str(tmp_path / "missing")).replace("FILE", str(tmp_path / "file"))
    text = text.replace("TMP", str(tmp_path)).replace("FIFO", str(tmp_path / "fifo"))
    path = tmp_path / "gpuledger.yaml"
    path.write_text(text)
    wanted = problem.replace("FILE", str(tmp_path / "file")).replace("TMP", str(tmp_path))
    wanted = wanted.replace("FIFO", str(tmp_path / "fifo"))
    checked = gpuledger("check-config", str(path), timeout=30)
    assert checked.returncode == 2
    [line] = checked.stderr.splitlines()
    assert wanted in line
    # run (on the host's NVML, so the ledger path is used) refuses the same config, in one line.
    ran = gpuledger("run", "--config", str(path), "--listen", "127.0.0.1:0", timeout=30)
    assert ran.returncode == 2
    [line] = ran.stderr.splitlines()
    assert wanted in line


# Broken YAML: what libyaml's parser says differs from the pure-Python parser's message, and the
# latter, the one a user is shown, names the problem better (and its line, for "[1, 2").
BROKEN_YAML = [
    ("a: b: c\n", ": line 1: mapping values are not allowed here"),
    ("a: [1, 2\n", ": line 2: expected ',' or ']', but got '<stream end>'"),
    ("a: *nope\n", ": line 1: found undefined alias 'nope'"),
    ("a: {x: 1}\nb: {x: 2, y: 3, x: 4}\n", ": line 2: duplicate key 'x' in one mapping"),
]


@pytest.mark.parametrize(("text", "message"), BROKEN_YAML)
def test_broken_yaml_is_named_by_the_pure_python_parser(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(YamlFileError) as raised:
        read_yaml(path, "settings")
    assert str(raised.value) == f"{path}{message}"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=documents)
def test_libyaml_reads_any_document_as_the_pure_python_parser_does(tmp_path: Path, document: object) -> None:
    # read_yaml parses with libyaml where PyYAML has it: the data must be what safe_load gives
    # (or, for a key that is not text, the one line saying so).
    path = tmp_path / "doc.yaml"
    text = yaml.safe_dump(document)
    path.write_text(text)
    expected = yaml.safe_load(text)
    if has_a_key_not_text(expected):
        with pytest.raises(YamlFileError, match="keys must be text"):
            read_yaml(path, "any")
    else:  # compared as YAML again: a NaN in the document is not equal to itself
        assert yaml.safe_dump(read_yaml(path, "any")) == yaml.safe_dump(expected)


def has_a_key_not_text(node: object) -> bool:
    if isinstance(node, dict):
        return any(not isinstance(k, str) or has_a_key_not_text(v) for k, v in node.items())
    return isinstance(node, list) and any(has_a_key_not_text(item) for item in node)

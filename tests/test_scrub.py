"""Credentials never leave the agent through a label, a log line, a ledger row or a report."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from agent.config import Settings
from agent.scrub import LABEL_MAX_CHARS, REDACTED, bound_label, escape_control, scrub, scrub_label
from tests.helpers import Rig

CANARY = "canary7Q2x9"

# Each shape a secret takes in a command line or a model argument, with the canary as the secret.
SECRET_SHAPES = [
    f"https://alice:{CANARY}@hub.example.com/org/model",
    f"https://{CANARY}@github.com/org/repo.git",
    f"s3://bucket/weights.safetensors?X-Amz-Signature={CANARY}&X-Amz-Expires=60",
    f"https://hub.example.com/m?token={CANARY}",
    f"https://hub.example.com/m#access_token={CANARY}",
    f"--hf-token={CANARY}",
    f"--hf-token {CANARY}",
    f"--api-key {CANARY}",
    f"HF_TOKEN={CANARY}",
    f"aws_secret_access_key={CANARY}",
    f"password: {CANARY}",
    f"db_password={CANARY};other=1",
    f"Authorization: Bearer {CANARY}abcdef",
    f"hf_{CANARY}abcdefghijklmnopqrstuv",
    f"ghp_{CANARY}abcdefghijklmnopqrstuv",
    f"sk-{CANARY}abcdefghijklmnopqrstuv",
    "AKIA" + CANARY.upper()[:8] + "ABCDEFGH",
    # These passed untouched: a secret word glued to the name, camelCase, quoted values, JSON,
    # a Slack webhook's path.
    f"PGPASSWORD={CANARY}",
    f"HFTOKEN={CANARY}",
    f"--accessToken {CANARY}",
    f"clientSecret={CANARY}",
    f'--password="{CANARY}"',
    f"password='{CANARY}'",
    f'{{"api_key": "{CANARY}"}}',
    f"https://hooks.slack.com/services/T0001/B0001/{CANARY}",
    # Short password options passed untouched: mysql's glued -p, sshpass's -p, redis-cli's -a.
    f"mysql -h db -u root -p{CANARY} orders",
    f"/usr/bin/mysqldump -u root -p {CANARY}",
    f"sshpass -p {CANARY} ssh gpu-node-01",
    f"redis-cli -h cache -a {CANARY} ping",
    f"docker login -u bob -p {CANARY} registry.example.com",
    f"curl -u alice:{CANARY} https://hub.example.com",
    f"curl --user alice:{CANARY} https://hub.example.com",
    # An authorization header without a scheme word, or glued to its colon.
    f"curl -H Authorization:{CANARY} https://hub.example.com",
    f"curl --header 'Proxy-Authorization: {CANARY}' https://hub.example.com",
    # A password written unencoded, holding "@", "?" or "#": the part beyond its first one stayed.
    f"postgres://app:x@{CANARY}@db.internal/orders",
    f"redis://:{CANARY}?x@cache:6379/0",
    f"mongodb+srv://admin:{CANARY}#x@cluster0.example.net/test",
    # ... or "/", which ended the authority: all of the password stayed.
    f"https://bob:{CANARY}/x@hub.example.com/org/model",
    f"postgres://app:a/{CANARY}@db.internal:5432/orders",
    # Userinfo without a scheme, as git, ssh and pip's git+ take it.
    f"git clone alice:{CANARY}@git.example.com:org/repo.git",
    f"pip install git+alice:{CANARY}@git.example.com/org/pkg",
    f"--remote=bob:x@{CANARY}@git.example.com",
    # A name and its value separated by a space only, after a tool's "config set".
    f"aws configure set aws_secret_access_key {CANARY}",
    f"aws configure set --profile prod aws_session_token {CANARY}",
    f"npm config set _authToken {CANARY}",
    # "pass" glued to what it is the password of.
    f"mytool --dbpass={CANARY}",
    f"mytool --smtppass {CANARY}",
    f"MYSQL_ROOTPWD={CANARY}",
    # A header whose scheme takes parameters: every one of them goes.
    f'Authorization: Digest username="bob", realm="hub", nonce="abc", response="{CANARY}"',
    f'curl -H \'Authorization: Digest username="bob", uri="/x", response="{CANARY}"\' https://hub.example.com',
    f"Authorization: AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20260101/us-east-1/s3/aws4_request, "
    f"SignedHeaders=host;x-amz-date, Signature={CANARY}",
    # Well-known token shapes that passed: GitLab, Google, npm, PyPI, Stripe, Databricks.
    f"glpat-{CANARY}abcdefghijk",
    f"AIza{CANARY}abcdefghijklmnopqrstuvwx",
    f"npm_{CANARY}abcdefghijklmnopqrstuvwxy",
    f"pypi-AgE{CANARY}abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyz",
    f"sk_live_{CANARY}abcdefghijklmn",
    "dapi" + "0123456789abcdef" * 2,
    # A passphrase (an SSH or signing key's) is a password by another name.
    f"--passphrase {CANARY}",
    f"SSH_KEY_PASSPHRASE={CANARY}",
    # A session cookie is a login: in a header (every pair of it), or as curl's -b/--cookie.
    f'curl -H "Cookie: theme=dark; session={CANARY}" https://hub.example.com',
    f"wget --header=Cookie:sid={CANARY} https://hub.example.com",
    f"Set-Cookie: sid={CANARY}; Path=/",
    f'curl -b "theme=dark; sid={CANARY}" https://hub.example.com',
    f"curl -bsid={CANARY} https://hub.example.com",
    f"curl --cookie sid={CANARY} https://hub.example.com",
    f"curl --cookie=sid={CANARY} https://hub.example.com",
    f"curl -b 'sid='{CANARY} https://hub.example.com",  # a shell word, quoted in part
]


@pytest.mark.parametrize("shape", SECRET_SHAPES)
def test_every_secret_shape_is_removed(shape: str) -> None:
    out = scrub(shape)
    secret = {"AKIA": "AKIA" + CANARY.upper()[:8] + "ABCDEFGH", "dapi": "0123456789abcdef"}.get(shape[:4], CANARY)
    assert secret not in out
    assert secret.lower() not in out.lower()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # The URL keeps host and path; only its userinfo and query go.
        ("https://user:pass@hub.example.com/org/m?token=abc", "https://hub.example.com/org/m"),
        # The name stays so a reader sees that something was removed and why.
        ("--hf-token=abc123", f"--hf-token={REDACTED}"),
        ("HF_TOKEN=abc123 python train.py", f"HF_TOKEN={REDACTED} python train.py"),
        ("Authorization: Bearer abcdefghijk", f"Authorization: Bearer {REDACTED}"),
        # A password program's -p goes, its port (-P) and database stay; elsewhere -p is a port.
        ("mysql -P 3306 -u root -pS3cr3t orders", f"mysql -P 3306 -u root -p{REDACTED} orders"),
        ("mysql -p -u root orders", "mysql -p -u root orders"),  # -p alone prompts: nothing to remove
        # A header's value goes however short it is; its scheme word stays.
        ("curl -H 'Authorization: token abc123' x", f"curl -H 'Authorization: token {REDACTED}' x"),
        ("curl --header Authorization: Bearer abc x", f"curl --header Authorization: Bearer {REDACTED} x"),
        ("python -m vllm.entrypoints.api_server -p 8000", "python -m vllm.entrypoints.api_server -p 8000"),
        # Userinfo runs to the host's last "@"; an "@" in the path is the path's.
        ("postgres://app:p@ss@db.internal/orders", "postgres://db.internal/orders"),
        ("--model hf://org/llama@v2", "--model hf://org/llama@v2"),
        ("https://bob:pa/ss@hub.example.com/org/m", "https://hub.example.com/org/m"),
        ("git clone alice:tok@git.example.com:org/repo", "git clone git.example.com:org/repo"),
        ("aws configure set aws_secret_access_key abc", f"aws configure set aws_secret_access_key {REDACTED}"),
        (
            'curl -H \'Authorization: Digest username="bob", response="x"\' https://h/x',
            f"curl -H 'Authorization: Digest {REDACTED}' https://h/x",
        ),
        # A port's colon is no password's: the "@" after it is the path's.
        ("https://hub.example.com:8443/org/llama@v2", "https://hub.example.com:8443/org/llama@v2"),
        ("git+https://git.example.com:/org/repo@main", "git+https://git.example.com:/org/repo@main"),
        # A cookie option's value goes; the URL and curl's other options stay.
        (
            'curl -b "a=1; sid=x" --cookie-jar jar.txt -o out https://hub.example.com/x',
            f"curl -b {REDACTED} --cookie-jar jar.txt -o out https://hub.example.com/x",
        ),
        ("curl -H 'Cookie: a=1; sid=x' https://h/x", f"curl -H 'Cookie: {REDACTED}' https://h/x"),
    ],
)
def test_what_remains_is_the_harmless_part(text: str, expected: str) -> None:
    assert scrub(text) == expected


@pytest.mark.parametrize(
    "benign",
    [
        "meta-llama/Llama-3.1-8B-Instruct",
        "BAAI/bge-large-en-v1.5",
        "llama-3-8b",
        "--tokenizer bert-base-uncased",  # "token" inside a longer word is no secret name
        "max_tokens=512",
        "maxTokens=512",
        "--num-tokens 3",
        "author=alice",
        "https://hub.example.com/org/model",
        "/models/llama/7b",
        "nginx.service",
        "ssh -p 2222 gpu-node-01",
        "docker run -p 3306:3306 mysql:8",
        "mysql-coder -p 3",
        "docker run -p 8000:8000 vllm/vllm-openai",
        "curl --user-agent gpuledger https://hub.example.com",
        "kube-apiserver --authorization-mode=Node,RBAC",
        "aws configure set region us-east-1",
        "--bypass=cache --compass=north --passes=3 --surpass 2",
        "OLDPWD=/home/alice",
        "git clone git@github.com:org/repo.git",
        "nginx:1.25@sha256:0123456789abcdef0123456789abcdef",
        "registry.example.com:5000/org/vllm@sha256:0123456789abcdef",
        "vllm serve org/llama:v2@main --port 8000",
        "tar -b 20 -cf out.tar /data",  # -b is a cookie only after curl
        "--cookie-policy strict",
        "",
    ],
)
def test_ordinary_names_are_untouched(benign: str) -> None:
    assert scrub_label(benign) == benign


def test_control_characters_cannot_forge_a_second_line() -> None:
    forged = "job-1\n2026-11-23 07:00:00 WARNING gpuledger: flag cleared\x1b[2J"
    out = escape_control(forged)
    assert "\n" not in out
    assert "\x1b" not in out
    assert out == "job-1\\n2026-11-23 07:00:00 WARNING gpuledger: flag cleared\\x1b[2J"


texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=80)


@given(prefix=texts, suffix=texts, shape=st.sampled_from(SECRET_SHAPES))
def test_a_secret_anywhere_in_any_text_is_removed(prefix: str, suffix: str, shape: str) -> None:
    # Surrounded by spaces, as a secret is in a command line; the text around it is arbitrary.
    out = scrub_label(f"{prefix} {shape} {suffix}")
    if CANARY not in prefix + suffix:
        assert CANARY not in out


@given(texts)
def test_scrubbing_is_idempotent_and_leaves_no_control_character(text: str) -> None:
    once = scrub_label(text)
    assert scrub_label(once) == once
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in once)


@pytest.mark.parametrize(
    "text",
    [
        # Each was scrubbed again differently: one pass's redaction made the next pass's match.
        'Authorization: username="b",',
        'Authorization:response="c"x',
        "Cookie: set;;x",
        "curl -b ' x 'y=z' curl",
        "-Haws_secret_access_keyhttps://;user:pw@host",
        "https://config.io:org/r-p@user:pw@",
    ],
)
def test_scrubbing_these_is_idempotent(text: str) -> None:
    once = scrub(text)
    assert scrub(once) == once


def _logged(*, debug: bool) -> list[str]:
    """The lines SafeFormatter writes for a warning quoting a forged line and a secret, then an
    exception whose text quotes a URL with a password."""
    import io
    import logging

    from agent.cli.logs import LOG_FORMAT, SafeFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(SafeFormatter(LOG_FORMAT, debug=debug))
    logger = logging.getLogger("gpuledger.test_scrub")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        value = f"job-1\n2026-11-23 07:00:00 WARNING gpuledger: forged --hf-token {CANARY}"
        logger.warning("process %s left the GPU", value)
        try:
            raise RuntimeError(f"cannot reach https://bob:{CANARY}@hub.example.com/x")
        except RuntimeError:
            logger.exception("poll failed for %s", "x\ny")
    finally:
        logger.removeHandler(handler)
    assert CANARY not in stream.getvalue()
    return stream.getvalue().splitlines()


def test_a_log_line_stays_one_line_without_the_secret() -> None:
    lines = _logged(debug=True)
    assert lines[0].endswith(
        f"process job-1\\n2026-11-23 07:00:00 WARNING gpuledger: forged --hf-token {REDACTED} left the GPU"
    )
    # With --debug the traceback (the agent's own code) keeps its lines; the message does not.
    assert lines[1].endswith("poll failed for x\\ny")
    assert lines[2] == "Traceback (most recent call last):"
    assert lines[-1] == "RuntimeError: cannot reach https://hub.example.com/x"


def test_an_exception_without_debug_is_one_scrubbed_line() -> None:
    # log.exception wrote the traceback at ERROR without --debug, and the exception's text
    # (here a URL with its password) unscrubbed.
    lines = _logged(debug=False)
    assert len(lines) == 2
    assert lines[1].endswith("poll failed for x\\ny (RuntimeError: cannot reach https://hub.example.com/x)")


# -- end to end: a secret in a command line never leaves the agent ---------------------------

SECRET_SCENARIO = """
start: 2026-11-20T18:00:00Z
node: {hostname: leaky-node, instance_type: p4d.24xlarge}
gpus: [{model: A100-SXM4-80GB, count: 2}]
processes:
  - pid: 4343
    gpus: [1]
    sm_util: 50
    memory_mib: 1000
    uid: 1001
    user: bob
    cmdline: "python train.py"
    environ: {SLURM_JOB_ID: "77", SLURM_JOB_ACCOUNT: "acct?token=SECRETACC8"}
  - pid: 4242
    gpus: [0]
    sm_util: 80
    memory_mib: 1000
    uid: 1000
    user: alice
    cmdline: "python serve.py --model https://alice:s3cretpw@hub.example/org/m?token=abc123xyz --port 8000"
"""


def test_a_credential_in_the_model_argument_reaches_no_output(tmp_path: Path) -> None:
    scenario = tmp_path / "leaky.yaml"
    scenario.write_text(SECRET_SCENARIO)
    ledger, metrics = tmp_path / "ledger.db", tmp_path / "metrics.prom"

    def gpuledger(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=120, check=False
        )
        assert result.returncode == 0, result.stderr
        return result.stdout + result.stderr

    def ledger_rows() -> str:
        with closing(sqlite3.connect(ledger)) as conn:
            return "\n".join(str(row) for row in conn.execute("SELECT * FROM workload_hours").fetchall())

    outputs = {
        "simulate": gpuledger(
            "simulate",
            str(scenario),
            "--for",
            "1h",
            "--step",
            "60s",
            "--ledger",
            str(ledger),
            "--metrics-out",
            str(metrics),
        ),
        "metrics": metrics.read_text(),
        "report": gpuledger("report", "--ledger", str(ledger), "--by", "model", "--format", "csv"),
        "report by account": gpuledger("report", "--ledger", str(ledger), "--by", "account,team", "--format", "csv"),
        "export": gpuledger("export", "--ledger", str(ledger)),
        "snapshot": gpuledger("snapshot", "--fake", str(scenario), "--json"),
        "snapshot table": gpuledger("snapshot", "--fake", str(scenario)),
        "ledger rows": ledger_rows(),
    }
    for name, text in outputs.items():
        assert "s3cretpw" not in text, name
        assert "abc123xyz" not in text, name
        assert "alice:" not in text, name
        assert "SECRETACC8" not in text, name  # a Slurm account from the job's own environment
    assert "acct" in outputs["report by account"]  # the account itself stays, its token does not
    # The model keeps what identifies it: the URL without its userinfo and query string.
    for name in ("metrics", "report", "snapshot", "ledger rows"):
        assert "https://hub.example/org/m" in outputs[name], name


# Two processes claiming job ids 100,000 characters long that differ only in their last digit, and
# a --model as long: a process's own environment and command line hold up to 128 KiB a value.
LONG_JOB = "7" * 99_999
LONG_VALUES = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "long-node"},
    "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
    "processes": [
        {
            "pid": 610 + gpu,
            "gpus": [gpu],
            "sm_util": 50,
            "uid": 1012,
            "user": "mallory",
            "cmdline": "python train.py --model " + "m" * 100_000,
            "environ": {"SLURM_JOB_ID": f"{LONG_JOB}{gpu}"},
        }
        for gpu in (0, 1)
    ],
}


def test_a_label_value_a_process_makes_enormous_is_cut_short_and_stays_distinct(tmp_path: Path) -> None:
    rig = Rig(LONG_VALUES, settings=Settings(node_name="long-node", pricing={"gpu_hourly": 2.0}))
    try:
        state = rig.run(3600.0, 60.0)
        text = rig.metrics(state)
    finally:
        rig.close()
    values = {
        (s.name, key): value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        for key, value in s.labels.items()
    }
    assert max(len(v) for v in values.values()) <= LABEL_MAX_CHARS
    jobs = {
        s.labels["hpc_job"] for f in text_string_to_metric_families(text) for s in f.samples if s.labels.get("hpc_job")
    }
    assert len(jobs) == 2  # cut short, the two claims are still two workloads
    assert all(job.startswith("7" * 200) for job in jobs)
    if shutil.which("promtool"):
        check = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60, check=False
        )
        assert check.returncode == 0, check.stdout + check.stderr
    # $2/GPU-hour: each process held its GPU the whole hour, $2 each, nothing idle or unobserved;
    # 2 GPUs x 1h x $2 = $4 in all.
    charged = sorted(t.dollars for t in state.costs.workloads.values())
    assert charged == pytest.approx([2.0, 2.0])
    idle = sum(g.idle_dollars for g in state.costs.gpus.values())
    unobserved = sum(g.unobserved_dollars for g in state.costs.gpus.values())
    assert sum(charged) + idle + unobserved == pytest.approx(2 * 1 * 2.0)


@given(st.text(max_size=600))
def test_a_bounded_label_is_short_clean_and_idempotent(text: str) -> None:
    bounded = bound_label(text)
    assert len(bounded) <= LABEL_MAX_CHARS
    assert bound_label(bounded) == bounded
    assert bounded == scrub_label(text) or len(scrub_label(text)) > LABEL_MAX_CHARS

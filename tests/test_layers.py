"""The architecture's import contracts ([tool.importlinter] in pyproject.toml) hold, and each
one fails when broken: a violation is planted in a temporary copy of the code and import-linter
must reject it, naming the contract."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agent", "exporters", "rules", "fake_nvml")
LINT_IMPORTS = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LINT_IMPORTS, "--config", str(tree / "pyproject.toml"), "--no-cache"],
        check=False,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The project's packages and pyproject.toml, copied."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_code_keeps_every_contract(tree: Path) -> None:
    result = lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


# (file, line planted at its end, the contract that must break)
VIOLATIONS = [
    ("exporters/prometheus.py", "from agent.pipeline import Pipeline", "Exporters render the agent's state"),
    ("agent/pipeline.py", "import pynvml", "Only agent/devices/nvml.py imports pynvml"),
    ("exporters/textfile.py", "import pynvml", "Only agent/devices/nvml.py imports pynvml"),
    ("agent/accounting/cost.py", "import sqlite3", "Accounting and the flag rules are pure"),
    ("agent/accounting/pricing.py", "from agent.yamlfile import read_yaml", "Accounting and the flag rules are pure"),
    ("rules/engine.py", "from pathlib import Path", "Accounting and the flag rules are pure"),
    ("agent/attribution/resolve.py", "from agent.attribution.sources.procfs import ProcFS", "resolve step is pure"),
    ("agent/attribution/labels.py", "from pathlib import Path", "resolve step is pure"),
    ("agent/devices/sampler.py", "from agent.pipeline import Pipeline", "Each layer imports only the layers below it"),
    ("agent/ledger/store.py", "import fake_nvml", "Only the command line imports the fake node"),
    ("fake_nvml/lib.py", "from agent.devices.sampler import Sampler", "The fake node stands in for the driver"),
    ("agent/actions/engine.py", "from agent.pipeline import Pipeline", "Actions act on the published state only"),
    ("agent/actions/runner.py", "from agent.ledger.store import Ledger", "Actions act on the published state only"),
    ("agent/actions/policy.py", "import subprocess", "Which actions are due, and what they are told, is pure"),
    ("agent/actions/context.py", "from pathlib import Path", "Which actions are due, and what they are told, is pure"),
]


@pytest.mark.parametrize(("path", "line", "contract"), VIOLATIONS, ids=[f"{p}:{c[:20]}" for p, _, c in VIOLATIONS])
def test_a_planted_violation_breaks_its_contract(tree: Path, path: str, line: str, contract: str) -> None:
    with (tree / path).open("a") as f:
        f.write(f"\n{line}  # noqa\n")
    result = lint_imports(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    # The report ends with each broken contract's name, whole, and the import that broke it.
    _summary, _, broken = result.stdout.partition("Broken contracts")
    assert contract in broken, result.stdout
    assert f"-> {line.split()[1]}" in broken  # the imported module, as planted


def test_the_readme_architecture_names_every_module() -> None:
    """The README's drawing is how a newcomer finds their way: a module it does not name is a
    room the map leaves out. Every package folder and every module in them must appear in it
    (generated gRPC stubs and package markers aside)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    missing = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if path.name == "__init__.py" and path.parent != ROOT / package:
                folder = f"{path.parent.name}/"
                if folder not in section:
                    missing.append(str(relative.parent) + "/")
                continue
            if path.name in ("__init__.py", "__main__.py") or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            if path.stem not in section:
                missing.append(str(relative))
    assert not missing, f"README's architecture section does not name: {', '.join(missing)}"

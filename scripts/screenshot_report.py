"""Make docs/report.png, the README's picture of `gpuledger report --format html`.

Simulates two shipped scenarios as two nodes over the same three days (`demo`: a training job,
a shared serving GPU, idle notebooks; `weekend-idle`: a job that dies on Friday night and leaves
eight GPUs idle until Monday), reports both ledgers as one page, and has Debian's chromium
(headless, through playwright) take a full-page screenshot of it.

    python3 scripts/screenshot_report.py [--out docs/report.png] [--keep DIR]

Needs what the tests need: `pip install -e '.[test]'` and `apt-get install chromium`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = ("demo", "weekend-idle")
SPAN = "3d"
STEP = "5m"  # a picture needs no finer grain, and three days of two nodes take seconds at it
WIDTH_PX = 1200


def gpuledger(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "agent", *args], cwd=REPO, check=True, stderr=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "report.png")
    parser.add_argument("--keep", type=Path, help="also keep the ledgers and the page in this directory")
    args = parser.parse_args()
    browser_binary = shutil.which("chromium")
    if browser_binary is None:
        print("screenshot_report: chromium is not installed (apt-get install chromium)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="gpuledger-report-") as scratch:
        work = Path(scratch)
        ledgers = work / "ledgers"
        ledgers.mkdir()
        for scenario in SCENARIOS:
            gpuledger("simulate", scenario, "--for", SPAN, "--step", STEP, "--ledger", str(ledgers / f"{scenario}.db"))
        page_file = work / "report.html"
        gpuledger("report", "--ledger", str(ledgers), "--format", "html", "--out", str(page_file))
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=browser_binary)
            page = browser.new_page(viewport={"width": WIDTH_PX, "height": 900})
            page.goto(page_file.resolve().as_uri())
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out), full_page=True)
            browser.close()
        if args.keep is not None:
            shutil.copytree(work, args.keep, dirs_exist_ok=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

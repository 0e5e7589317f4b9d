"""Screenshots of `moe-train plan --serve` for docs/planner.md, taken with Debian's Chromium
(/usr/bin/chromium) through Playwright: olmoe-1b-7b.yaml on 8 H100, then on 64 B200 with 32
experts. Run from the repository root: `uv run python scripts/planner_screenshots.py`."""

import subprocess
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
INPUTS = {
    "planner-page-8-h100.png": {},
    "planner-page-64-b200.png": {"#gpus": "64", "#num_experts": "32", "#gpu": "b200"},
}


def main() -> None:
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moe_train.cli",
            "plan",
            "configs/olmoe-1b-7b.yaml",
            "--serve",
            "--port",
            "0",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = server.stdout.readline().split()[-1]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 1500})
            page.goto(address)
            for name, fields in INPUTS.items():
                page.wait_for_selector("body[data-planned]", timeout=300_000)
                for selector, value in fields.items():
                    if selector == "#gpu":
                        page.select_option(selector, value)
                    else:
                        page.fill(selector, value)
                page.wait_for_timeout(1000)
                page.wait_for_function("!document.body.classList.contains('busy')", timeout=300_000)
                page.screenshot(path=ROOT / "docs" / name)
                print("wrote", ROOT / "docs" / name)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()

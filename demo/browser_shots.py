"""Screenshots of the store's trajectory browser in the system's Chromium (selenium; no browser download).

    python -m demo.browser_shots --store demo_out/store-<hash> --out /tmp/graft-shots \\
        --tokenizer demo_out/models/learner-<hash>/starts/early --tokenizer demo_out/models/peer-<hash>/starts/peer

starts `graft-store serve` over the store on a free loopback port, opens each view (overview, the prompts one
model failed and its peer solved, one of those prompts, a peer rollout's tokens) and writes a PNG per view.
The browser tests (tests/store/test_browser_ui.py) drive Chromium through the same `chromium()` and
`open_view()`. Needs Debian's `chromium` and `chromium-driver` (`apt-get install -y chromium chromium-driver`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import httpx

# flags that work in a container without a display, a GPU or a network
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars", "--force-device-scale-factor=1"]
WIDTH = 1400


def chromium(width: int = WIDTH, height: int = 1000):
    """A headless Chromium under chromedriver, both Debian's, with a fresh profile; console messages kept."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver is None:
        raise RuntimeError("Chromium and its driver are not installed: apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    profile = tempfile.mkdtemp(prefix="graft-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(options=options, service=Service(driver))
    browser.profile_dir = profile  # removed by close()
    return browser


def close(browser) -> None:
    browser.quit()
    shutil.rmtree(browser.profile_dir, ignore_errors=True)


def open_view(browser, url: str, timeout_s: float = 60.0) -> None:
    """Load a view and wait until app.js has drawn it (or its error message): #view[data-ready] is its path."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    WebDriverWait(browser, timeout_s).until(lambda b: b.execute_script(
        "const v = document.getElementById('view');"
        "return v && v.dataset.ready === location.pathname + location.search;"))


def save_screenshot(browser, path: Path, max_height: int = 2400) -> Path:
    """The whole page (up to max_height pixels) as a PNG at `path`."""
    height = browser.execute_script("return Math.ceil(document.documentElement.scrollHeight)")
    width = browser.get_window_size()["width"]
    browser.set_window_size(width, min(max(height, 500), max_height))
    path.parent.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(path))
    return path


def shrink_png(path: Path, colours: int = 192) -> None:
    """Re-save a screenshot as a palette PNG (a third of the size; the page's flat colours survive)."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colours, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.browser_shots", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", type=Path, required=True, help="store root (the demo's: demo_out/store-<key>)")
    parser.add_argument("--out", type=Path, required=True, help="where the PNGs go")
    parser.add_argument("--overwrite", action="store_true", help="replace screenshots already there (docs/img's are committed)")
    parser.add_argument("--tokenizer", type=Path, action="append", default=[], help="a model directory (repeat)")
    parser.add_argument("--learner", default="toy-learner-llama",
                        help="the model whose failures the peer solves (the first model id starting so)")
    parser.add_argument("--peer", default="toy-peer-qwen2", help="the peer model (the first model id starting so)")
    args = parser.parse_args(argv)
    taken = sorted(p.name for p in args.out.glob("browser-*.png")) if args.out.is_dir() else []
    if taken and not args.overwrite:
        raise SystemExit(f"{args.out} already holds {', '.join(taken)}: pass --overwrite to replace them, or another --out")

    from graft.services.store_api.http.testing import StoreServer

    with StoreServer(args.store, env={"GRAFT_STORE_TOKENIZERS": json.dumps([str(p) for p in args.tokenizer])}) as server:
        api = httpx.Client(base_url=server.url, timeout=120)
        models = sorted(m["model_id"] for m in api.get("/v1/stats").raise_for_status().json()["models"])
        learner, peer = (next((m for m in models if m.startswith(prefix)), None) for prefix in (args.learner, args.peer))
        if learner is None or peer is None:
            raise SystemExit(f"{args.store} holds groups of {models}: pass --learner and --peer")
        graft = f"failed_by={learner}&solved_by={peer}"
        grafted = api.get(f"/v1/prompts?{graft}&limit=20").raise_for_status().json()["prompts"]
        if not grafted:
            raise SystemExit(f"no prompt that {learner} failed and {peer} solved in {args.store}")
        prompt = max(grafted, key=lambda p: p["groups"])["prompt_id"]  # the one with the most to compare
        peer_group = api.get(f"/v1/prompts/{prompt}/groups?model={peer}&limit=1").raise_for_status().json()["groups"][0]
        # a correct peer rollout, the longest: what the learner would be taught, with the most tokens to colour
        position = max(range(len(peer_group["rollouts"])),
                       key=lambda i: (peer_group["rollouts"][i]["correct"], peer_group["rollouts"][i]["num_tokens"]))
        views = {"overview": "/ui/", "prompts": f"/ui/prompts?{graft}", "prompt": f"/ui/prompt/{prompt}",
                 "rollout": f"/ui/rollout/{peer_group['rollouts'][0]['group_id']}/{position}"}
        browser = chromium()
        try:
            for name, path in views.items():
                open_view(browser, server.url + path)
                shot = save_screenshot(browser, args.out / f"browser-{name}.png")
                shrink_png(shot)
                print(f"{shot} ({shot.stat().st_size // 1024} KiB): {server.url}{path}")
                browser.set_window_size(WIDTH, 1000)
        finally:
            close(browser)
    return 0


if __name__ == "__main__":
    sys.exit(main())

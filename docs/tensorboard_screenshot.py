"""Retake the TensorBoard screenshots of README and ``docs/tensorboard.md``: the CommTimer's cards, lines included.

The picture in README (``docs/tensorboard_comm.png``) is the quickstart run twice, with naive and bucketed DDP.
From the repository root, on a machine with Debian's Chromium (``apt-get install -y chromium``)::

    python -m lightning_ddp fit --config configs/quickstart.yaml --trainer.strategy naive_ddp \\
        --trainer.logger.init_args.save_dir /tmp/shots --trainer.logger.init_args.name naive_ddp
    python -m lightning_ddp fit --config configs/quickstart.yaml \\
        --trainer.logger.init_args.save_dir /tmp/shots --trainer.logger.init_args.name bucketed_ddp
    python docs/tensorboard_screenshot.py naive_ddp=/tmp/shots/naive_ddp/version_0 \\
        bucketed_ddp=/tmp/shots/bucketed_ddp/version_0 -o docs/tensorboard_comm.png

``NAME=DIR`` shows the runs under ``DIR`` as ``NAME`` (``NAME/<subdir>`` for runs in subdirectories); a bare
``DIR`` keeps TensorBoard's names, relative to it: ``/tmp/shots`` alone gives the same two runs, named
``naive_ddp/version_0`` and ``bucketed_ddp/version_0``. ``--help`` lists the options (size, smoothing, ...).

The straggler cards (``comm/wait_ms``, ``comm/transfer_ms``, ``straggler/rank``, ``straggler/lag_ms``,
``step/rank_spread_ms``, with ``comm/exposed_ms`` for scale): the quickstart without and with an injected straggler
(``lightning_ddp.callbacks.SlowRank``), and a tag filter that picks those six::

    python -m lightning_ddp fit --config configs/quickstart.yaml \\
        --trainer.logger.init_args.save_dir /tmp/shots --trainer.logger.init_args.name no_delay
    python -m lightning_ddp fit --config configs/quickstart.yaml \\
        --trainer.callbacks+=lightning_ddp.callbacks.SlowRank --trainer.callbacks.delay_ms 20 \\
        --trainer.logger.init_args.save_dir /tmp/shots --trainer.logger.init_args.name slow_rank_20ms
    python docs/tensorboard_screenshot.py no_delay=/tmp/shots/no_delay/version_0 \\
        slow_rank_20ms=/tmp/shots/slow_rank_20ms/version_0 \\
        --tag-filter 'comm/(exposed|wait|transfer)_ms|straggler/|rank_spread' --size 1800x1000 \\
        -o docs/tensorboard_straggler.png

The CommTimer's own views (``docs/tensorboard.md``): its custom-scalars layout for the quickstart and naive DDP, and
the HPARAMS table of four strategies sorted by median step time (``--dashboard``; ``--sort-by`` names a metric or
hyperparameter column)::

    for s in naive_ddp ddp zero2_ddp; do python -m lightning_ddp fit --config configs/quickstart.yaml \\
        --trainer.strategy $s --trainer.logger.init_args.save_dir /tmp/shots --trainer.logger.init_args.name $s; done
    python -m lightning_ddp fit --config configs/quickstart.yaml \\
        --trainer.logger.init_args.save_dir /tmp/shots --trainer.logger.init_args.name quickstart
    python docs/tensorboard_screenshot.py --dashboard custom_scalars --size 1450x1900 --colors 128 \\
        naive_ddp=/tmp/shots/naive_ddp/version_0 quickstart=/tmp/shots/quickstart/version_0 \\
        -o docs/tensorboard_custom_scalars.png
    python docs/tensorboard_screenshot.py --dashboard hparams --sort-by median/step/time_ms --size 2800x330 \\
        --colors 128 naive_ddp=/tmp/shots/naive_ddp/version_0 quickstart=/tmp/shots/quickstart/version_0 \\
        ddp=/tmp/shots/ddp/version_0 zero2_ddp=/tmp/shots/zero2_ddp/version_0 -o docs/tensorboard_hparams.png

The recipe:

1. link every event file under each ``DIR`` into a temporary log directory, below ``NAME/`` when given; start
   ``python -m tensorboard.main --logdir <it>`` on a free port of 127.0.0.1, in its own process group, and poll
   its HTTP API until every run's scalar tags are loaded;
2. start ``/usr/bin/chromium`` headless, with WebGL rendered in software by SwiftShader (``--use-gl=angle
   --use-angle=swiftshader --enable-unsafe-swiftshader``), and drive it over the DevTools protocol on a pipe
   (``--remote-debugging-pipe``: JSON messages ended by a NUL byte on file descriptors 3 and 4, so the standard
   library is enough);
3. open the Time Series dashboard with its tag filter, ``/?tagFilter=comm#timeseries``, wait until the cards have
   loaded their data and stopped changing, untick "Ignore outliers in chart scaling" (which would cut the peaks
   off: each y-axis would span only the 5th-95th percentile of its points; ``--ignore-outliers`` keeps it),
   close the settings pane, let the charts draw, and save a PNG of the window (``Page.captureScreenshot``). The
   Custom Scalars dashboard (``#custom_scalars``) is waited for and unticked the same way, through the shadow roots
   of its Polymer elements; on the HParams dashboard (``#hparams``) the table's cells are waited for and
   ``--sort-by`` is set as the query pane's "Sort by" menu sets it;
4. stop Chromium and TensorBoard (their whole process groups) and delete the temporary directory (links, logs,
   Chromium's profile), whatever happened.

Why not Chromium's own ``--screenshot --virtual-time-budget``: it captures the page but no chart lines. WebGL itself
works there (SwiftShader draws a test page), but the Time Series dashboard draws its lines in a Web Worker on an
``OffscreenCanvas`` at ``requestAnimationFrame``, and a worker's animation frames never come under virtual time.
Driven over DevTools in real time they do. ``--svg`` asks TensorBoard for its SVG charts instead (its own
``forceSVG`` flag), which needs no WebGL at all.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

#: Flags for headless Chromium on a closed network, as root: no sandbox, no first-run UI, and no background
#: connections (without these, Chromium's update and sync requests are refused and slow everything down).
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
#: WebGL without a GPU: ANGLE on SwiftShader, Chromium's software renderer (needs the "unsafe" opt-in since M139).
SOFTWARE_WEBGL_FLAGS = ("--use-gl=angle", "--use-angle=swiftshader", "--enable-unsafe-swiftshader")

# Polled in the page: how many scalar cards exist, and how many still show their loading spinner.
_CARDS_STATE_JS = """JSON.stringify({
  cards: document.querySelectorAll('scalar-card').length,
  loading: document.querySelectorAll('scalar-card mat-spinner, scalar-card mat-progress-spinner').length,
})"""
# TensorBoard's "Ignore outliers in chart scaling" (on by default) sets each y-axis to the 5th-95th percentile of
# the card's points, which cuts the peaks off the noisy cards (busy_ms, algbw_GBps). Returns whether it is still on.
_SHOW_OUTLIERS_JS = """(() => {
  const box = Array.from(document.querySelectorAll('mat-checkbox'))
    .find(b => b.textContent.includes('Ignore outliers in chart scaling'));
  const input = box && box.querySelector('input');
  if (!input) return null;
  if (input.checked) input.click();
  return input.checked;
})()"""
# The Time Series dashboard opens its settings pane on wide windows; it would cover a third of the cards.
_CLOSE_SETTINGS_JS = """(() => {
  const button = document.querySelector('button[aria-label="Close side pane"]');
  if (button) button.click();
  return Boolean(button);
})()"""

# The Custom Scalars and HParams dashboards are Polymer elements: their parts live in shadow roots, which
# querySelectorAll does not enter. `deep(selector)` collects the matches in the document and in every shadow root.
_DEEP_JS = """const deep = (selector, root = document, out = []) => {
  root.querySelectorAll(selector).forEach(e => out.push(e));
  root.querySelectorAll('*').forEach(e => { if (e.shadowRoot) deep(selector, e.shadowRoot, out); });
  return out;
};"""
# Custom Scalars: how many chart cards exist, and how many still show their spinner (every card has an active
# paper-spinner-lite; it is on the page, offsetParent set, only while the card loads).
_CUSTOM_SCALARS_STATE_JS = f"""(() => {{ {_DEEP_JS}
  return JSON.stringify({{cards: deep('tf-custom-scalar-multi-line-chart-card').length,
                          loading: deep('paper-spinner-lite').filter(s => s.offsetParent !== null).length}});
}})()"""
# Its "Ignore outliers in chart scaling" is a paper-checkbox (on by default), with the same effect as above.
_CUSTOM_SCALARS_SHOW_OUTLIERS_JS = f"""(() => {{ {_DEEP_JS}
  const box = deep('paper-checkbox').find(b => b.textContent.includes('Ignore outliers in chart scaling'));
  if (!box) return null;
  if (box.checked) box.click();
  return box.checked;
}})()"""
# HParams table: how many cells it shows (one per run and column, plus the headers); no spinner to wait for.
_HPARAMS_STATE_JS = f"""(() => {{ {_DEEP_JS}
  return JSON.stringify({{cards: deep('tf-hparams-table-view vaadin-grid-cell-content').length
                                 || deep('vaadin-grid-cell-content').length, loading: 0}});
}})()"""
# Sort the table by the column named COLUMN, ascending, as the query pane's "Sort by" and "Direction" menus do: its
# columns are the hyperparameters, then the metrics. Returns whether the column was found.
_HPARAMS_SORT_JS = f"""(() => {{ {_DEEP_JS}
  const pane = deep('tf-hparams-query-pane')[0];
  if (!pane || !pane._hparams || !pane._metrics) return false;
  const names = pane._hparams.map(h => h.info.name).concat(pane._metrics.map(m => m.info.name.tag));
  const index = names.indexOf(COLUMN);
  if (index < 0) return false;
  pane.set('_sortDirection', 0);
  pane.set('_sortByIndex', index);
  return true;
}})()"""

DASHBOARDS = ("timeseries", "custom_scalars", "hparams")
"""TensorBoard's dashboards this script can photograph (the part of the URL after ``#``)."""


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logdirs = [parse_logdir(spec) for spec in args.logdirs]
    chromium = shutil.which(args.chromium) or args.chromium
    if not os.access(chromium, os.X_OK):
        raise SystemExit(
            f"Chromium not found at {args.chromium!r}; install it (apt-get install -y chromium) or pass --chromium."
        )
    width, height = parse_size(args.size)
    # TensorBoard and Chromium run in their own sessions, so a signal to this script does not reach them: turn
    # SIGTERM and SIGHUP into an exit that unwinds `cleanup` and stops them (Ctrl-C already does).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    with contextlib.ExitStack() as cleanup:  # on any exit: stop Chromium, then TensorBoard, then delete workdir
        workdir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="tensorboard_screenshot_")))
        port = free_port()
        link_event_files(logdirs, workdir / "logs")
        tensorboard = start_tensorboard(workdir / "logs", port, workdir / "tensorboard.log", cleanup)
        base_url = f"http://127.0.0.1:{port}"
        runs = wait_for_scalars(base_url, tensorboard, workdir / "tensorboard.log", args.tag_filter, args.timeout)
        print(f"tensorboard on {base_url}: runs {', '.join(runs)}", file=sys.stderr)
        query = {"tagFilter": args.tag_filter}
        if args.svg:
            query["forceSVG"] = "true"
        if args.smoothing is not None:
            query["smoothing"] = str(args.smoothing)
        url = f"{base_url}/?{urllib.parse.urlencode(query)}#{args.dashboard}"
        browser = start_chromium(chromium, (width, height), not args.svg, workdir, cleanup)
        png = capture(browser, url, (width, height), args)
    if args.colors:
        png = reduce_colors(png, args.colors)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(png)
    print(f"wrote {output} ({width}x{height}, {len(png):,} bytes)", file=sys.stderr)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Details: the module docstring.")
    parser.add_argument("logdirs", nargs="+", metavar="[NAME=]DIR", help="TensorBoard log directories")
    parser.add_argument("-o", "--output", required=True, help="the PNG to write")
    parser.add_argument("--dashboard", choices=DASHBOARDS, default="timeseries",
                        help="timeseries (default): one card per tag; custom_scalars: the CommTimer's layout; "
                             "hparams: the table of runs")
    parser.add_argument("--sort-by", metavar="COLUMN",
                        help="hparams: sort the table by this column, ascending (e.g. median/step/time_ms)")
    parser.add_argument("--tag-filter", default="comm", help="regex of the tags to show (default: comm)")
    parser.add_argument("--size", default="1800x1450",
                        help="window size WIDTHxHEIGHT in pixels (default: 1800x1450: the eleven comm/ cards, 4 a "
                             "row)")
    parser.add_argument("--smoothing", type=float, help="TensorBoard's smoothing, 0 to 0.999 (default: its own, 0.6)")
    parser.add_argument("--ignore-outliers", action="store_true",
                        help="keep TensorBoard's default of cropping outliers out of the y-axis range")
    parser.add_argument("--svg", action="store_true", help="SVG charts instead of WebGL (TensorBoard's forceSVG)")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds to wait after the cards have loaded, for the charts to draw (default: 3)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds TensorBoard and the page each get to load (default: 120)")
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium binary")
    parser.add_argument("--colors", type=int,
                        help="reduce the PNG to this many colours (Pillow, which matplotlib brings), e.g. 128: a "
                             "third of the size for a page of charts")
    return parser.parse_args(argv)


def reduce_colors(png: bytes, colors: int) -> bytes:
    """``png`` with a palette of ``colors`` colours (median cut), saved with zlib's best compression."""
    import io

    from PIL import Image

    out = io.BytesIO()
    image = Image.open(io.BytesIO(png)).convert("RGB")
    image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(out, format="PNG", optimize=True)
    return out.getvalue()


def parse_logdir(spec: str) -> tuple[str, Path]:
    """``DIR`` or ``NAME=DIR`` -> (run name prefix, "" for a bare ``DIR``; the directory)."""
    name, _, path = spec.partition("=") if "=" in spec else ("", "", spec)
    directory = Path(path).expanduser().resolve()
    if not directory.is_dir():
        raise SystemExit(f"{path!r} is not a directory; pass TensorBoard log directories ([NAME=]DIR).")
    if name.strip("/") != name or ".." in Path(name).parts:
        raise SystemExit(f"run name {name!r} must be a relative name such as naive_ddp.")
    return name, directory


def link_event_files(logdirs: list[tuple[str, Path]], root: Path) -> None:
    """Mirror the event files of every ``(name, directory)`` under ``root/name`` as symlinks (TensorBoard's run names
    are the paths of their directories relative to ``--logdir``)."""
    for name, directory in logdirs:
        events = sorted(directory.rglob("events.out.tfevents.*"))
        if not events:
            raise SystemExit(f"{directory} holds no TensorBoard event file (events.out.tfevents.*).")
        for event in events:
            link = root / name / event.relative_to(directory)
            if link.exists() or link.is_symlink():
                raise SystemExit(f"two inputs put a run at {link.relative_to(root)}; name them with NAME=DIR.")
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(event)


def parse_size(size: str) -> tuple[int, int]:
    try:
        width, height = (int(part) for part in size.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--size {size!r} is not WIDTHxHEIGHT, e.g. 1250x1250.") from None
    return width, height


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---- processes: each in its own group, stopped with everything it started --------------------------------


def start_process(command: list[str], log: Path, cleanup: contextlib.ExitStack, **kwargs) -> subprocess.Popen:
    """Start ``command`` in a new session (its own process group) and register stopping that group on exit."""
    with open(log, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, **kwargs)
    cleanup.callback(stop_process_group, process)
    return process


def stop_process_group(process: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process's group (with TensorBoard's data server, Chromium's renderers), then SIGKILL what is left."""
    # start_new_session made the process a group leader: the group id is its pid, and only what it started is in it.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def tail(path: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def start_tensorboard(logdir: Path, port: int, log: Path, cleanup: contextlib.ExitStack) -> subprocess.Popen:
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1",
               "--port", str(port)]
    return start_process(command, log, cleanup)


def wait_for_scalars(
    base_url: str, tensorboard: subprocess.Popen, log: Path, tag_filter: str, timeout: float
) -> list[str]:
    """Poll until TensorBoard serves, and every run it lists has loaded a scalar tag matching ``tag_filter``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tensorboard.poll() is not None:
            raise RuntimeError(f"tensorboard exited with {tensorboard.returncode}:\n{tail(log)}")
        try:
            runs = json.load(urllib.request.urlopen(f"{base_url}/data/runs", timeout=5))
            tags = json.load(urllib.request.urlopen(f"{base_url}/data/plugin/scalars/tags", timeout=5))
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            runs, tags = [], {}
        ready = [run for run in runs if any(re.search(tag_filter, tag) for tag in tags.get(run, {}))]
        if runs and len(ready) == len(runs):
            return runs
        time.sleep(0.5)
    raise TimeoutError(
        f"tensorboard at {base_url} showed no '{tag_filter}' scalars for every run within {timeout:.0f} s; are these "
        f"the right log directories?\n{tail(log)}"
    )


# ---- Chromium over the DevTools protocol on a pipe --------------------------------------------------------


class DevToolsPipe:
    """A minimal DevTools-protocol client over ``--remote-debugging-pipe``: send a command, read until its answer.

    Chromium reads commands on its file descriptor 3 and writes answers and events on 4, each a JSON object ended by
    a NUL byte. Events are not needed here and are dropped.
    """

    def __init__(self, process: subprocess.Popen, to_browser: int, from_browser: int, log: Path) -> None:
        self.process, self.to_browser, self.from_browser, self.log = process, to_browser, from_browser, log
        self._buffer = b""
        self._next_id = 0

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60.0) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buffer:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Chromium did not answer {method} within {timeout:.0f} s")
                chunk = os.read(self.from_browser, 1 << 20)
                if not chunk:
                    exit_code = self.process.poll()
                    raise RuntimeError(f"Chromium closed the DevTools pipe (exit {exit_code}):\n{tail(self.log)}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") != self._next_id:
                continue  # an event
            if "error" in answer:
                raise RuntimeError(f"{method} failed: {answer['error']}")
            return answer["result"]

    def close(self, grace: float = 5.0) -> None:
        """Ask Chromium to quit (it then reaps its own renderers) and wait for it; the group is stopped after."""
        with contextlib.suppress(OSError, RuntimeError, TimeoutError, json.JSONDecodeError):
            if self.process.poll() is None:
                self.send("Browser.close", timeout=grace)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace)

    def evaluate(self, expression: str, session: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        return result["result"].get("value")


def start_chromium(
    chromium: str, size: tuple[int, int], use_webgl: bool, workdir: Path, cleanup: contextlib.ExitStack
) -> DevToolsPipe:
    profile, log = workdir / "chromium_profile", workdir / "chromium.log"  # a fresh profile every time
    to_browser_read, to_browser_write = os.pipe()
    from_browser_read, from_browser_write = os.pipe()

    def connect_pipe() -> None:  # in the child, before exec: our pipe ends become its fds 3 and 4
        read_end, write_end = os.dup(to_browser_read), os.dup(from_browser_write)  # above 4: the dup2s cannot clash
        os.dup2(read_end, 3)
        os.dup2(write_end, 4)

    command = [
        chromium, *CHROMIUM_FLAGS, *(SOFTWARE_WEBGL_FLAGS if use_webgl else ()),
        f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}", "--remote-debugging-pipe", "about:blank",
    ]
    try:
        # close_fds (the default) runs after connect_pipe and keeps only fds 3 and 4 besides stdio.
        process = start_process(command, log, cleanup, pass_fds=(3, 4), preexec_fn=connect_pipe)
    finally:
        os.close(to_browser_read)
        os.close(from_browser_write)
    # Registered after start_process, so unwound before its group is stopped: Browser.close, then close our ends.
    cleanup.callback(os.close, to_browser_write)
    cleanup.callback(os.close, from_browser_read)
    browser = DevToolsPipe(process, to_browser_write, from_browser_read, log)
    cleanup.callback(browser.close)
    return browser


def capture(browser: DevToolsPipe, url: str, size: tuple[int, int], args: argparse.Namespace) -> bytes:
    """Open ``url``, wait for the dashboard's cards (or table cells) to load and draw, and return the window's PNG."""
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    browser.send("Emulation.setDeviceMetricsOverride",
                 {"width": size[0], "height": size[1], "deviceScaleFactor": 1, "mobile": False}, session)
    browser.send("Page.navigate", {"url": url}, session)
    state_js = {"timeseries": _CARDS_STATE_JS, "custom_scalars": _CUSTOM_SCALARS_STATE_JS,
                "hparams": _HPARAMS_STATE_JS}[args.dashboard]
    wait_until_loaded(browser, session, state_js, url, args.timeout)
    if args.dashboard == "hparams":
        if args.sort_by and not browser.evaluate(_HPARAMS_SORT_JS.replace("COLUMN", json.dumps(args.sort_by)),
                                                 session):
            print(f"found no column {args.sort_by!r} to sort by", file=sys.stderr)
    else:
        show_outliers = _SHOW_OUTLIERS_JS if args.dashboard == "timeseries" else _CUSTOM_SCALARS_SHOW_OUTLIERS_JS
        if not args.ignore_outliers and browser.evaluate(show_outliers, session) is not False:
            print("could not untick 'Ignore outliers in chart scaling'; outliers stay cropped", file=sys.stderr)
    if args.dashboard == "timeseries" and not browser.evaluate(_CLOSE_SETTINGS_JS, session):
        print("found no settings pane to close", file=sys.stderr)
    time.sleep(args.settle)  # the cards re-lay out (without the pane, with the new columns), then the lines draw
    return base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png"}, session)["data"])


def wait_until_loaded(browser: DevToolsPipe, session: str, state_js: str, url: str, timeout: float) -> None:
    """Poll ``state_js`` (``{cards, loading}``) until some cards exist, none is loading, and the state held twice in
    a row (cards appear in waves)."""
    deadline = time.monotonic() + timeout
    previous = None
    while True:
        state = json.loads(browser.evaluate(state_js, session) or "{}")
        if state.get("cards") and not state.get("loading") and state == previous:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cards of {url} did not finish loading within {timeout:.0f} s ({state})")
        previous = state
        time.sleep(1.0)


if __name__ == "__main__":
    main()

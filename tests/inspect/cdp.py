"""A minimal Chrome DevTools Protocol client over `--remote-debugging-pipe` (standard library only).

Chromium reads NUL-terminated JSON commands from file descriptor 3 and writes replies and events
to descriptor 4, so no websocket library (and no Playwright download) is needed to drive the
Debian `chromium` package headless.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


def find_chromium() -> str | None:
    for path in (os.environ.get("TILELLM_CHROMIUM"), *CHROMIUM_CANDIDATES):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


class Browser:
    """One headless Chromium process and one page (a flattened target session)."""

    def __init__(self, executable: str, *, width: int = 1200, height: int = 900, timeout: float = 60.0):
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="tilellm-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        # The child must see the pipes as fds 3 (commands in) and 4 (replies out).
        args = [
            executable,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            # Nothing but the page: no network, updates or sync traffic of its own.
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--remote-debugging-pipe",
            f"--user-data-dir={self._profile.name}",
            f"--window-size={width},{height}",
            "about:blank",
        ]

        def child_fds() -> None:
            # Move both ends out of the way first: either may already be fd 3 or 4.
            r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
            w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=child_fds,
            pass_fds=(3, 4),
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Runtime.enable", session=True)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    # -- protocol ----------------------------------------------------------------------------------

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no reply from chromium")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError(f"chromium closed the pipe (exit code {self.proc.poll()})")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, *, session: bool = False, **params: Any) -> dict:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str) -> dict:
        for i, ev in enumerate(self.events):
            if ev.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + self.timeout
        while True:
            ev = self._read_message(deadline)
            if ev.get("method") == method:
                return ev
            self.events.append(ev)

    # -- page helpers ------------------------------------------------------------------------------

    def goto(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def screenshot(self, path: str, *, full_page: bool = True) -> None:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.evaluate(
                "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]"
            )
            params["clip"] = {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.call("Page.captureScreenshot", session=True, **params)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        self._profile.cleanup()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

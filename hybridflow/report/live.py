"""`hybridflow view RUN_DIR`: a local page that follows a run while it trains (and shows a finished one).

    hybridflow view outputs/grpo_tiny               # http://127.0.0.1:8765/ (--port, --host to widen)

The server (aiohttp's web server) reads only the run's own files, each as it grows: `metrics.jsonl` (the
curves), `rollouts.jsonl` (training rows token by token: `hybridflow.tracking.rollout_records`) and
`samples.jsonl` (validation completions). The page (`view.html`, drawn with Plotly's bundled plotly.js)
polls the JSON routes below every two seconds:

    GET /api/run                 the run directory's name and which files it has
    GET /api/metrics?since=K     metric rows from the K-th on (a resumed run's repeated step: the last wins)
    GET /api/rollouts            the steps that have token-level records
    GET /api/rollouts/<step>     that step's records
    GET /api/samples             validation samples

A line still being written (no newline yet) waits for the next read; a line that is not JSON is counted
and skipped, as `hybridflow report` does.
"""

from __future__ import annotations

import json
import socket
from importlib import resources
from pathlib import Path
from typing import Any

from hybridflow.report.runlog import ReportError

POLL_FILES = ("metrics.jsonl", "rollouts.jsonl", "samples.jsonl")


class JsonlTail:
    """The JSON-object lines of a file that grows by appends, read incrementally. Each kept line is
    `(byte offset, object)`; `keep_objects=False` keeps only the step and offset (the records are read again
    when asked for), so a long run's token-level file is not held in memory."""

    def __init__(self, path: Path, keep_objects: bool = True) -> None:
        self.path, self.keep_objects = path, keep_objects
        self.offset = 0
        self.rows: list[tuple[int, dict[str, Any]]] = []
        self.unreadable = 0

    def read(self) -> list[tuple[int, dict[str, Any]]]:
        """Reads what was appended since the last call; returns every row so far."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return self.rows
        if size < self.offset:  # the file was replaced (a new run in the same directory): start over
            self.offset, self.rows, self.unreadable = 0, [], 0
        if size > self.offset:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(size - self.offset)
            end = data.rfind(b"\n") + 1  # a torn last line waits for its newline
            start = 0
            for line in data[:end].split(b"\n")[:-1]:
                at = self.offset + start
                start += len(line) + 1
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None
                if not isinstance(row, dict):
                    self.unreadable += 1
                    continue
                self.rows.append((at, row if self.keep_objects else {"step": row.get("step")}))
            self.offset += end
        return self.rows

    def line_at(self, offset: int) -> dict[str, Any]:
        with open(self.path, "rb") as f:
            f.seek(offset)
            return json.loads(f.readline())


class RunView:
    """The run directory's files, read as they grow (see the module docstring)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.root = Path(run_dir).expanduser()
        if not self.root.is_dir():
            raise ReportError(f"run directory {self.root} does not exist (pass a run's trainer.output_dir)")
        self.metrics = JsonlTail(self.root / "metrics.jsonl")
        self.rollouts = JsonlTail(self.root / "rollouts.jsonl", keep_objects=False)
        self.samples = JsonlTail(self.root / "samples.jsonl")

    def run(self) -> dict[str, Any]:
        return {"name": self.root.name, "path": str(self.root),
                "files": [name for name in POLL_FILES if (self.root / name).is_file()],
                "unreadable_lines": self.metrics.unreadable + self.rollouts.unreadable + self.samples.unreadable}

    def metric_rows(self, since: int) -> dict[str, Any]:
        rows = [row for _, row in self.metrics.read()]
        return {"rows": rows[max(since, 0):], "next": len(rows)}

    def rollout_steps(self) -> list[int]:
        return sorted({row["step"] for _, row in self.rollouts.read() if isinstance(row.get("step"), int)})

    def rollout_records(self, step: int) -> list[dict[str, Any]]:
        return [self.rollouts.line_at(at) for at, row in self.rollouts.read() if row.get("step") == step]

    def sample_rows(self) -> list[dict[str, Any]]:
        return [row for _, row in self.samples.read()]


def page_html() -> str:
    return resources.files("hybridflow.report").joinpath("view.html").read_text(encoding="utf-8")


def plotly_js() -> bytes:
    """plotly.js as the `plotly` package bundles it (the page works offline)."""
    return resources.files("plotly").joinpath("package_data", "plotly.min.js").read_bytes()


def make_app(run_dir: str | Path) -> Any:
    """The aiohttp application serving `run_dir` (see the module docstring)."""
    from aiohttp import web

    view = RunView(run_dir)
    script = plotly_js()

    async def index(_: web.Request) -> web.Response:
        return web.Response(text=page_html(), content_type="text/html")

    async def plotly(_: web.Request) -> web.Response:
        return web.Response(body=script, content_type="application/javascript",
                            headers={"Cache-Control": "max-age=86400"})

    async def run(_: web.Request) -> web.Response:
        return web.json_response(view.run())

    async def metrics(request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            raise web.HTTPBadRequest(text="since must be an integer (the number of rows already read)") from None
        return web.json_response(view.metric_rows(since))

    async def rollout_steps(_: web.Request) -> web.Response:
        return web.json_response({"steps": view.rollout_steps()})

    async def rollout_step(request: web.Request) -> web.Response:
        try:
            step = int(request.match_info["step"])
        except ValueError:
            raise web.HTTPBadRequest(text="the step must be an integer") from None
        return web.json_response({"step": step, "records": view.rollout_records(step)})

    async def samples(_: web.Request) -> web.Response:
        return web.json_response({"rows": view.sample_rows()})

    app = web.Application()
    app.add_routes([web.get("/", index), web.get("/static/plotly.min.js", plotly), web.get("/api/run", run),
                    web.get("/api/metrics", metrics), web.get("/api/rollouts", rollout_steps),
                    web.get("/api/rollouts/{step}", rollout_step), web.get("/api/samples", samples)])
    return app


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serves `run_dir` until interrupted (Ctrl-C); port 0 takes any free port, and the printed address has it."""
    from aiohttp import web

    app = make_app(run_dir)
    try:
        sock = socket.create_server((host, port))
    except OSError as e:
        raise ReportError(f"cannot listen on {host}:{port} ({e.strerror}): pass another --port, or --port 0 "
                          f"for any free one") from None
    print(f"hybridflow view: http://{host}:{sock.getsockname()[1]}/ (Ctrl-C stops)", flush=True)
    web.run_app(app, sock=sock, print=None)

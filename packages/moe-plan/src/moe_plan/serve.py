"""`moe-plan --serve` (and `moe-train plan --serve`): the planner as a local page.

A thread-per-request HTTP server on 127.0.0.1 serves one static page (page/) and JSON
endpoints. Each request's fields become the words of a `moe-plan` command line, which
the CLI's own parser and planner answer (`plan_words_of`), so the page shows what
`moe-plan --json` prints: the rows it shows (answer.py), and any layout's full
row or further rows on request (/api/layout, /api/rows). Errors come back as 4xx answers
with each message keyed by the field it names, in the CLI's words.
"""

from __future__ import annotations

import json
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from moe_plan.answer import FITTING_SHOWN, LISTS, MOST_ROWS, Answered
from moe_plan.config import load_config
from moe_plan.errors import UserError
from moe_plan.report import paused_gc

FIELDS = {
    "gpu": "--gpu",
    "gpus": "--gpus",
    "gpus_per_node": "--gpus-per-node",
    "tokens": "--tokens",
    "n_layers": "--model.n_layers",
    "d_model": "--model.d_model",
    "num_experts": "--model.moe.num_experts",
    "top_k": "--model.moe.top_k",
    "expert_hidden": "--model.moe.expert_hidden",
    "seq_len": "--data.seq_len",
    "vocab_size": "--model.vocab_size",
}
"""Each input of the page and the word of `moe-plan` it becomes."""

DEVICE_DEFAULTS = {"gpu": "h100", "gpus": "8", "gpus_per_node": "8", "tokens": "1e12"}
"""The device inputs the page opens with."""
OPENING_CONFIG = "olmoe-1b-7b.yaml"
"""The shipped config the page opens on unless one is preselected: its own layout starts, and
fits, on the DEVICE_DEFAULTS."""

ASSETS = {"/": "index.html", "/page.js": "page.js", "/page.css": "page.css"}
TYPES = {"html": "text/html", "js": "text/javascript", "css": "text/css"}
PASTED = "pasted.yaml"
MAX_BODY = 1 << 20
CACHED = 8
"""Plans kept, so that going back to earlier inputs, and asking for more rows or a layout's
figures, is instant."""
PLAN_KEYS = ("config", "yaml", "search", *FIELDS)
"""The request fields that choose the plan (the others choose what of it is sent)."""

Answer = Callable[..., tuple[Any, int | None]]
"""`moe-plan`'s words to the Plan and the token budget (`cli.plan_words_of`; the
page asks for its first rows ranked, `ranked=FITTING_SHOWN`, and the rest on request)."""


class BadRequest(Exception):
    """A request the page's server refuses: its status and the message of each field."""

    def __init__(self, status: HTTPStatus, errors: dict[str, str], plan: Any = None):
        super().__init__(next(iter(errors.values())))
        self.status, self.errors, self.plan = status, errors, plan


class Planner:
    """Turns the page's requests into plan command lines and answers them."""

    def __init__(self, answer: Answer, configs: dict[str, Path]):
        self.answer, self.configs = answer, configs
        self._cache: OrderedDict[str, Answered] = OrderedDict()
        self._lock = threading.Lock()

    def plan(self, request: dict[str, Any]) -> dict[str, Any]:
        """{"argv": the equivalent command's words, "plan": what `--json` prints, with the
        first rows of each list (`Answered.first`)}. The cyclic garbage collector waits
        (`paused_gc`): it would pass over the plan's many objects while they are made."""
        with paused_gc():
            answered = self.answered(request)
            answer = {"argv": answered.argv, "plan": answered.first()}
        if not answered.plan.fitting:
            raise BadRequest(
                HTTPStatus.UNPROCESSABLE_ENTITY, {"gpus": _fits_nowhere(answer["plan"])}, answer
            )
        return answer

    def rows(self, request: dict[str, Any]) -> dict[str, Any]:
        """More rows of a list: {"rows", "start", "total"} for the request's "list"
        ("fitting" or "rejected"), "start" and "count"."""
        which, start, count = request.get("list"), request.get("start"), request.get("count")
        if which not in LISTS:
            raise BadRequest(HTTPStatus.BAD_REQUEST, {"list": f"list must be one of {LISTS}"})
        for name, value, low in (("start", start, 0), ("count", count, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value:
                raise BadRequest(
                    HTTPStatus.BAD_REQUEST, {name: f"{name} must be an integer >= {low}"}
                )
        with paused_gc():
            answered = self.answered(request)
            rows = answered.rows(which, start, min(count, MOST_ROWS))
        return {"rows": rows, "start": start, "total": answered.count(which)}

    def layout(self, request: dict[str, Any]) -> dict[str, Any]:
        """{"layout": the full row, as `--json` lists it} of the layout the request's
        "layout" names (its label)."""
        label = request.get("layout")
        if not isinstance(label, str):
            raise BadRequest(HTTPStatus.BAD_REQUEST, {"layout": "layout must be a layout's label"})
        row = self.answered(request).layout(label)
        if row is None:
            raise BadRequest(HTTPStatus.NOT_FOUND, {"layout": f"no layout {label!r} in this plan"})
        return {"layout": row}

    def answered(self, request: dict[str, Any]) -> Answered:
        """The plan of the request's inputs, from the cache or planned now."""
        key = json.dumps({k: request.get(k) for k in PLAN_KEYS}, sort_keys=True, default=str)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        with self._config_path(request) as (path, source):
            words = self._words(request)
            try:
                plan, tokens = self.answer(
                    [str(path), *words], search=bool(request.get("search")), ranked=FITTING_SHOWN
                )
            except UserError as e:
                raise _refusal(str(e), path, source) from e
        argv = ["moe-plan", self._shown(request), *words, "--json"]
        answered = Answered(plan, tokens, argv)
        with self._lock:
            self._cache[key] = answered
            while len(self._cache) > CACHED:
                self._cache.popitem(last=False)
        return answered

    def config_yaml(self, request: dict[str, Any]) -> str:
        """The config with the page's model knobs and the chosen layout's overrides, as YAML
        that `moe-train train` reads."""
        layout = request.get("overrides", [])
        if not isinstance(layout, list) or not all(isinstance(w, str) for w in layout):
            raise BadRequest(HTTPStatus.BAD_REQUEST, {"overrides": "overrides must be a list"})
        words = [w for w in self._words(request) if w.startswith(("--model.", "--data."))]
        with self._config_path(request) as (path, source):
            try:
                config = load_config(path, words + layout)
            except UserError as e:
                raise _refusal(str(e), path, source) from e
        head = f"# {self._shown(request)} with {' '.join(words + layout) or 'no overrides'}\n"
        return head + yaml.safe_dump(config.to_dict(), sort_keys=False)

    def inputs(self, request: dict[str, Any]) -> dict[str, str]:
        """The config's own value of each model input of the page (what an empty field
        means), as text."""
        with self._config_path(request) as (path, source):
            try:
                config = load_config(path)
            except UserError as e:
                raise _refusal(str(e), path, source) from e
        values = {}
        for field, flag in FIELDS.items():
            if flag.startswith(("--model.", "--data.")):
                value: Any = config
                for name in flag.removeprefix("--").split("."):
                    value = getattr(value, name)
                values[field] = str(value)
        return values

    def _words(self, request: dict[str, Any]) -> list[str]:
        words = []
        for field, flag in FIELDS.items():
            value = request.get(field)
            if value is None or str(value).strip() == "":
                continue
            words.append(f"{flag}={str(value).strip()}")
        return words

    def _shown(self, request: dict[str, Any]) -> str:
        if request.get("yaml") is not None:
            return PASTED
        return str(self.configs.get(str(request.get("config")), PASTED))

    def _config_path(self, request: dict[str, Any]):
        return _ConfigPath(request, self.configs)


class _ConfigPath:
    """The request's config as a file: a listed one, or the pasted YAML in a scratch folder."""

    def __init__(self, request: dict[str, Any], configs: dict[str, Path]):
        self.request, self.configs, self.scratch = request, configs, None

    def __enter__(self) -> tuple[Path, str]:
        text = self.request.get("yaml")
        if text is not None:
            if not isinstance(text, str):
                raise BadRequest(HTTPStatus.BAD_REQUEST, {"yaml": "the YAML must be text"})
            self.scratch = tempfile.TemporaryDirectory(prefix="moe-plan-")
            path = Path(self.scratch.name) / PASTED
            path.write_text(text)
            return path, "yaml"
        name = self.request.get("config")
        if not isinstance(name, str) or name not in self.configs:
            listed = ", ".join(self.configs) or "none (paste one)"
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, {"config": f"config {name!r} is not one of {listed}"}
            )
        return self.configs[name], "config"

    def __exit__(self, *exc) -> None:
        if self.scratch is not None:
            self.scratch.cleanup()


def _fits_nowhere(plan: dict[str, Any]) -> str:
    """Why no layout of the asked device count runs, and where one would."""
    if not plan.get("closest"):
        return f"no layout starts on {plan['world_size']} devices: " + (
            plan["rejected_groups"][0]["reason"] if plan["rejected_groups"] else "none to try"
        )
    message = f"no layout fits {plan['device']['memory_gib']:g} GiB per device"
    best = (plan.get("smallest_fitting") or {}).get("layout")
    if best is not None:
        return message + f"; one fits on {best['world_size']} devices"
    if "smallest_fitting" in plan:
        return message + f" on up to {plan['smallest_fitting']['tried_to']} devices"
    return message + " on this many devices (find the smallest count below)"


def _refusal(message: str, path: Path, source: str) -> BadRequest:
    """The CLI's message (the scratch folder left out), keyed by the field it names: the
    earliest-named input, else the config."""
    if source == "yaml":
        message = message.replace(str(path), PASTED)
    field = source
    if not message.startswith((PASTED, str(path), "config file")):
        named = {}
        for name, flag in FIELDS.items():
            word = flag.removeprefix("--") if flag.startswith("--model") or "data" in flag else flag
            found = re.search(rf"(?<![\w.-]){re.escape(word)}(?![\w-])", message)
            if found is None and word != flag:
                found = re.search(rf"(?<![\w.]){re.escape(flag)}(?![\w-])", message)
            if found is not None:
                named[name] = found.start()
        if named:
            field = min(named, key=named.get)
    return BadRequest(HTTPStatus.BAD_REQUEST, {field: message})


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        if self.path == "/api/configs":
            self._json(HTTPStatus.OK, self._configs())
            return
        if self.path not in ASSETS:
            self._json(HTTPStatus.NOT_FOUND, {"errors": {"path": f"no page at {self.path}"}})
            return
        name = ASSETS[self.path]
        body = resources.files("moe_plan").joinpath("page", name).read_bytes()
        self._send(HTTPStatus.OK, body, TYPES[name.rsplit(".", 1)[1]] + "; charset=utf-8")

    def do_POST(self) -> None:
        try:
            request = self._request()
            if self.path == "/api/plan":
                self._json(HTTPStatus.OK, self.server.planner.plan(request))
            elif self.path == "/api/rows":
                self._json(HTTPStatus.OK, self.server.planner.rows(request))
            elif self.path == "/api/layout":
                self._json(HTTPStatus.OK, self.server.planner.layout(request))
            elif self.path == "/api/inputs":
                self._json(HTTPStatus.OK, {"inputs": self.server.planner.inputs(request)})
            elif self.path == "/api/config":
                text = self.server.planner.config_yaml(request)
                self._send(HTTPStatus.OK, text.encode(), "application/yaml; charset=utf-8")
            else:
                raise BadRequest(HTTPStatus.NOT_FOUND, {"path": f"no endpoint {self.path}"})
        except BadRequest as e:
            body: dict[str, Any] = {"errors": e.errors}
            if e.plan is not None:
                body.update(e.plan)
            self._json(e.status, body)
        except Exception as e:  # a fault of the planner's, not of the input: say so
            message = f"the planner failed on this request ({type(e).__name__}: {e})"
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"errors": {"request": message}})

    def _configs(self) -> dict[str, Any]:
        listed: dict[str, Any] = {
            "configs": list(self.server.planner.configs),
            "opening": self.server.opening,
            "devices": DEVICE_DEFAULTS,
        }
        if not listed["configs"]:
            places = " or ".join(str(p.resolve()) + "/*.yaml" for p in self.server.looked_in)
            listed["note"] = (
                f"no shipped configs found (looked in {places or 'no folder'}): start "
                "`moe-plan CONFIG --serve` with a config, or paste one as YAML"
            )
        return listed

    def _request(self) -> dict[str, Any]:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            raise BadRequest(
                HTTPStatus.BAD_REQUEST, {"request": f"a JSON body of at most {MAX_BODY} bytes"}
            )
        try:
            request = json.loads(self.rfile.read(length))
        except (ValueError, UnicodeDecodeError):
            request = None
        if not isinstance(request, dict):
            raise BadRequest(HTTPStatus.BAD_REQUEST, {"request": "the body must be a JSON object"})
        return request

    def _json(self, status: HTTPStatus, data: Any) -> None:
        self._send(status, json.dumps(data).encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would bury the address line


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    planner: Planner
    looked_in: list[Path]
    opening: str | None


def config_folders() -> list[Path]:
    """Where the page looks for configs to list: the repository's configs/ when this package
    runs from a development install of it (the configs are not packaged), then configs/ in
    the working directory."""
    root = Path(__file__).resolve().parents[4]
    folders = [Path("configs")]
    if (root / "packages" / "moe-plan").is_dir() and (root / "configs").is_dir():
        repository = root / "configs"
        if repository.is_relative_to(Path.cwd().resolve()):  # shown as the command would be
            repository = repository.relative_to(Path.cwd().resolve())
        folders.insert(0, repository)
    return folders


def shipped_configs(
    preselected: Path | None, folders: list[Path] | Path | None = None
) -> dict[str, Path]:
    """The configs the page lists: `preselected` first, then each folder's *.yaml (default:
    `config_folders()`), by file name; a name already listed keeps its first file."""
    if folders is None:
        folders = config_folders()
    configs = {}
    if preselected is not None:
        configs[preselected.name] = preselected
    for folder in [folders] if isinstance(folders, Path) else folders:
        for path in sorted(folder.glob("*.yaml")):
            configs.setdefault(path.name, path)
    return configs


def opening_config(configs: dict[str, Path], preselected: Path | None = None) -> str | None:
    """The listed config the page opens on: `preselected`, else OPENING_CONFIG when listed,
    else the first listed (None: none is)."""
    if preselected is not None and preselected.name in configs:
        return preselected.name
    if OPENING_CONFIG in configs:
        return OPENING_CONFIG
    return next(iter(configs), None)


def make_server(
    answer: Answer,
    configs: dict[str, Path],
    port: int,
    looked_in: list[Path] | None = None,
    opening: str | None = None,
) -> _Server:
    """A server on 127.0.0.1:`port` (0: any free port), not yet serving; `looked_in` names
    the folders searched for configs, for the page to say where none was found; `opening`:
    the config the page opens on (default `opening_config(configs)`)."""
    server = _Server(("127.0.0.1", port), _Handler)
    server.planner = Planner(answer, configs)
    server.looked_in = looked_in or []
    server.opening = opening if opening is not None else opening_config(configs)
    return server


def serve(port: int, answer: Answer, preselected: Path | None) -> None:
    """Serve the page until interrupted."""
    if preselected is not None and not preselected.is_file():
        raise UserError(f"config file {preselected} does not exist")

    folders = config_folders()
    configs = shipped_configs(preselected, folders)
    try:
        server = make_server(answer, configs, port, folders, opening_config(configs, preselected))
    except (OSError, OverflowError) as e:  # in use, not allowed, or no port at all
        reason = getattr(e, "strerror", None) or str(e)
        raise UserError(f"--port {port}: cannot listen there ({reason})") from e
    print(f"the planner's page: http://127.0.0.1:{server.server_address[1]}/", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()

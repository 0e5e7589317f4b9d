"""`moe-plan --serve`: the page's server answers with `moe-plan --json`'s figures,
refuses bad input at the field it names in the CLI's words, and keeps answering; the page, in
a real headless Chromium, shows the CLI's figures and downloads a config that trains."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from moe_plan.answer import FITTING_SHOWN, REJECTED_SHOWN
from moe_plan.cli import main, plan_json_of, plan_words_of
from moe_plan.config import load_config
from moe_plan.errors import UserError
from moe_plan.layouts import layout_label, start_error
from moe_plan.serve import (
    DEVICE_DEFAULTS,
    FIELDS,
    OPENING_CONFIG,
    config_folders,
    make_server,
    opening_config,
    shipped_configs,
)

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")


@contextlib.contextmanager
def _serving(configs: dict[str, Path], looked_in: list[Path] | None = None):
    server = make_server(plan_words_of, configs, 0, looked_in)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def url():
    with _serving(shipped_configs(None, ROOT / "configs")) as address:
        yield address


def _post(url: str, path: str, body: bytes | dict, headers: dict | None = None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_tokens_give_gpu_hours_and_days(capsys):
    code, out, _ = _cli(
        [str(ROOT / "configs/tiny.yaml"), "--gpus", "2", "--tokens", "3e9", "--json"],
        capsys,
    )
    plan = json.loads(out)
    assert code == 0 and plan["tokens"] == 3_000_000_000
    for row in [plan["own"], *plan["fitting"]]:
        per_device = row["tokens_per_s_per_device"]
        assert row["gpu_hours"] == pytest.approx(3e9 / per_device / 3600, rel=1e-12)
        assert row["days"] == pytest.approx(3e9 / (per_device * 2) / 86400, rel=1e-12)
    _, text, _ = _cli([str(ROOT / "configs/tiny.yaml"), "--gpus", "2", "--tokens", "3e9"], capsys)
    hours = plan["own"]["gpu_hours"]
    assert f"3,000,000,000 tokens: {hours:,.0f} GPU-hours, {plan['own']['days']:,.1f} days" in text


BAD = {
    "a non-number": ({"gpus": "eight"}, "gpus", ["--gpus=eight"]),
    "zero GPUs": ({"gpus": "0"}, "gpus", ["--gpus=0"]),
    "top-k over the experts": ({"top_k": "99"}, "top_k", ["--model.moe.top_k=99"]),
    "an unknown GPU": ({"gpu": "a100"}, "gpu", ["--gpu=a100"]),
    "a bad token budget": ({"tokens": "lots"}, "tokens", ["--tokens=lots"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_at_its_field_in_the_clis_words(url, case, capsys):
    fields, field, words = BAD[case]
    status, body = _post(url, "/api/plan", {"config": "tiny.yaml", "gpus": "2", **fields})
    assert status == 400, body
    errors = json.loads(body)["errors"]
    assert list(errors) == [field]
    code, _, err = _cli([str(ROOT / "configs/tiny.yaml"), "--gpus=2", *words], capsys)
    assert code == 2 and errors[field] in err, (errors, err)


def test_pasted_yaml_with_an_unknown_key_and_a_model_that_fits_nowhere(url):
    status, body = _post(url, "/api/plan", {"yaml": "model:\n  wings: 2\n", "gpus": "8"})
    (field, message), *more = json.loads(body)["errors"].items()
    assert status == 400 and field == "yaml" and not more
    assert message.startswith("pasted.yaml: unknown config key model.wings")
    status, body = _post(url, "/api/plan", {"config": "moe-47b-a3b.yaml", "gpus": "1"})
    answer = json.loads(body)
    assert status == 422 and answer["errors"]["gpus"].startswith("no layout fits 79.6 GiB")
    assert answer["plan"]["closest"] and not answer["plan"]["fitting"]


def test_the_shipped_configs_are_listed_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert config_folders()[0] == Path("configs")  # shown as a command run here names them
    monkeypatch.chdir(tmp_path)
    folders = config_folders()
    assert folders[0] == ROOT / "configs"
    with _serving(shipped_configs(None, folders), folders) as address:
        with urllib.request.urlopen(address + "/api/configs", timeout=60) as response:
            listed = json.loads(response.read())
        status, body = _post(address, "/api/plan", {"config": "tiny.yaml", "gpus": "2"})
    shipped = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert listed == {"configs": shipped, "opening": OPENING_CONFIG, "devices": DEVICE_DEFAULTS}
    assert status == 200 and json.loads(body)["plan"]["fitting"]


def test_the_page_opens_on_a_config_whose_own_layout_starts_and_fits_on_its_devices(url):
    configs = shipped_configs(None, ROOT / "configs")
    opening = opening_config(configs)
    gpus = int(DEVICE_DEFAULTS["gpus"])
    assert start_error(load_config(configs[opening]), gpus) is None, opening
    status, body = _post(url, "/api/plan", {"config": opening, **DEVICE_DEFAULTS})
    own = json.loads(body)["plan"]["own"]
    assert status == 200 and own["starts"] and own["fits"], own
    # A preselected config is the one the page opens on, whatever it is.
    assert opening_config(configs, ROOT / "configs/tiny.yaml") == "tiny.yaml"
    assert opening_config(shipped_configs(None, [])) is None


@pytest.mark.parametrize("port", ["99999", "65536", "-1", "abc", "8o37"])
def test_a_port_that_is_no_port_is_one_line(port, capsys):
    code, out, err = _cli(["configs/tiny.yaml", "--serve", "--port", port], capsys)
    assert code == 2 and not out and "Traceback" not in err, err
    assert err.splitlines() == [
        f"error: --port {port} must be a whole number from 0 to 65535 (0: any free port)"
    ]


def test_a_port_the_server_cannot_listen_on_is_one_line(monkeypatch, capsys):
    import moe_plan.serve as serve

    def serve_forever(self, *args):
        raise AssertionError("the server listened")

    monkeypatch.setattr(serve._Server, "serve_forever", serve_forever)
    with pytest.raises(UserError, match=r"^--port 70000: cannot listen there \(.+\)$"):
        serve.serve(70000, plan_words_of, None)  # past the parser's check
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = _cli(["--serve", "--port", str(port)], capsys)
    assert code == 2 and not out and "Traceback" not in err, err
    assert err.splitlines() == [
        f"error: --port {port}: cannot listen there (Address already in use)"
    ]


def test_the_page_says_when_no_config_is_found(tmp_path):
    folders = [tmp_path / "configs", tmp_path / "elsewhere"]
    with (
        _serving(shipped_configs(None, folders), folders) as address,
        urllib.request.urlopen(address + "/api/configs", timeout=60) as response,
    ):
        listed = json.loads(response.read())
    assert listed["configs"] == [] and listed["note"].startswith("no shipped configs found")
    assert str(tmp_path / "configs") in listed["note"] and "paste" in listed["note"]


def test_the_model_inputs_are_the_configs_own_values(url):
    status, body = _post(url, "/api/inputs", {"config": "olmoe-1b-7b.yaml"})
    config = load_config(ROOT / "configs/olmoe-1b-7b.yaml")
    model, moe = config.model, config.model.moe
    expected = {
        "n_layers": model.n_layers,
        "d_model": model.d_model,
        "num_experts": moe.num_experts,
        "top_k": moe.top_k,
        "expert_hidden": moe.expert_hidden,
        "seq_len": config.data.seq_len,
        "vocab_size": model.vocab_size,
    }
    assert status == 200
    assert json.loads(body)["inputs"] == {name: str(v) for name, v in expected.items()}
    status, body = _post(url, "/api/inputs", {"yaml": "model:\n  d_model: 96\n"})
    assert status == 200 and json.loads(body)["inputs"]["d_model"] == "96"
    status, body = _post(url, "/api/inputs", {"yaml": "model:\n  wings: 2\n"})
    assert status == 400 and list(json.loads(body)["errors"]) == ["yaml"]


def test_the_answer_carries_the_shown_rows_and_the_rest_on_demand(url):
    fields = {"config": "olmoe-1b-7b.yaml", "gpus": "8", "tokens": "1e12"}
    status, body = _post(url, "/api/plan", fields)
    cli = plan_json_of([str(ROOT / "configs/olmoe-1b-7b.yaml"), "--gpus=8", "--tokens=1e12"])
    page = json.loads(body)["plan"]
    assert status == 200 and len(body) < len(json.dumps(cli)) / 20
    fitting, rejected = cli["fitting"], cli["rejected"]
    assert len(fitting) > 60 and sum(r["starts"] for r in rejected) > 400
    assert page["fitting"] == fitting[:FITTING_SHOWN]
    assert (page["fitting_count"], page["rejected_count"]) == (len(fitting), len(rejected))
    assert page["rejected"] == [_summary(r, cli) for r in rejected[:REJECTED_SHOWN]]
    rest = set(page) - {"fitting", "rejected", "fitting_count", "rejected_count"}
    assert rest == set(cli) - {"fitting", "rejected"}
    assert {k: page[k] for k in rest} == {k: cli[k] for k in rest}
    # More rows of either list, as the CLI lists them (the rejected ones summarized).
    more = {**fields, "list": "fitting", "start": 30, "count": 25}
    status, body = _post(url, "/api/rows", more)
    assert status == 200 and json.loads(body) == {
        "rows": fitting[30:55],
        "start": 30,
        "total": len(fitting),
    }
    status, body = _post(url, "/api/rows", {**more, "list": "rejected", "start": 600, "count": 99})
    assert json.loads(body)["rows"] == [_summary(r, cli) for r in rejected[600:699]]
    # Any layout's full figures by its label: rejected, fitting or the config's own.
    over = next(r for r in rejected[REJECTED_SHOWN:] if r["starts"])
    for row in [over, fitting[-1], cli["own"]]:
        status, body = _post(url, "/api/layout", {**fields, "layout": row["layout"]})
        assert status == 200 and json.loads(body) == {"layout": row}
    status, body = _post(url, "/api/layout", {**fields, "layout": "pp9 dp9"})
    assert status == 404 and "pp9 dp9" in json.loads(body)["errors"]["layout"]
    for bad, field in [
        ({"list": "all"}, "list"),
        ({"start": -1}, "start"),
        ({"count": "9"}, "count"),
    ]:
        status, body = _post(url, "/api/rows", {**more, **bad})
        assert status == 400 and list(json.loads(body)["errors"]) == [field]


def _summary(row: dict, plan: dict) -> dict:
    """A rejected layout's summary as the page gets it, from `plan --json`'s full row."""
    out = {k: row[k] for k in ("layout", "starts", "fits", "reason")}
    if row["starts"]:
        memory = row["memory_bytes"]
        out["memory_total_bytes"] = memory["total"]
        out["over_bytes"] = memory["total"] - plan["device"]["memory_gib"] * 2**30
        parts = {k: v for k, v in memory.items() if k != "total"}
        out["largest_part"] = max(parts, key=parts.__getitem__)
    return out


def _malformed(rng: random.Random) -> tuple[str, bytes, dict]:
    junk = [
        "",
        "-1",
        "0",
        "1e400",
        "nan",
        "2.5",
        "x" * 5000,
        "８",
        "\u0000",
        "[1, 2]",
        "{a: 1}",
        "--json",
        "7 --gpus 9",
        "null",
        "true",
        "1e3",
        "-0",
    ]
    kind = rng.randrange(6)
    if kind == 0:
        return "/api/plan", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))), {}
    if kind == 1:
        return "/api/plan", b"{}", {"Content-Length": "-5"}
    if kind == 2:
        path = rng.choice(
            ["/api/nothing", "/api/config", "/api/inputs", "/api/rows", "/api/layout"]
        )
        body = {"config": "tiny.yaml", "gpus": "2"}
        body["list"] = rng.choice(["fitting", "rejected", "all", 3, None])
        body["start"] = rng.choice([0, -1, "0", 1.5, True, 10**12, None])
        body["count"] = rng.choice([1, 0, 10**9, "5", [], None])
        body["layout"] = rng.choice(["pp1 dp2 ep1 mb1 rc:none", "", 7, None, {"a": 1}])
        return path, json.dumps(rng.choice([{"x": 1}, body])).encode(), {}
    body = {"config": rng.choice(["tiny.yaml", "../../etc/passwd", 3, None, "tiny"]), "gpus": "2"}
    for name in rng.sample(list(FIELDS), rng.randrange(1, 4)):
        body[name] = rng.choice([*junk, rng.randrange(-3, 3), [1], {"a": 1}, 1.5])
    if kind == 4:
        body = {
            "yaml": rng.choice(
                ["a: [", "- 1", "model: 3", "model:\n  d_model: x", 7, "parallel:\n  pp: -1", "\t:"]
            ),
            "gpus": "2",
        }
    if kind == 5:
        body["overrides"] = rng.choice([["--parallel.ep"], "x", [3], ["--nope=1"]])
        return "/api/config", json.dumps(body).encode(), {}
    return "/api/plan", json.dumps(body).encode(), {}


def test_two_hundred_malformed_requests_get_4xx_and_the_server_keeps_answering(url):
    rng = random.Random(37)
    statuses = []
    for _ in range(200):
        path, body, headers = _malformed(rng)
        status, answer = _post(url, path, body, headers)
        assert status < 500, (path, body[:200], answer[:300])
        statuses.append(status)
        if status >= 400:
            assert json.loads(answer)["errors"]
    assert statuses.count(200) < 40 and len(set(statuses)) >= 2
    status, body = _post(url, "/api/plan", {"config": "tiny.yaml", "gpus": "2"})
    assert status == 200 and json.loads(body)["plan"]["fitting"]


def _shown_rows(page, table: str) -> list[list[str]]:
    return page.eval_on_selector_all(
        f"#{table} tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
    )


def _cells(row: dict, i: int) -> list[str]:
    """A row of the page's tables, formatted from the JSON as the page formats it."""
    from moe_plan.layouts import format_bytes
    from moe_plan.report import _percent

    step = row["step_s"]
    return [
        str(i),
        row["layout"],
        format_bytes(row["memory_bytes"]["total"]),
        f"{row['tokens_per_s_per_device']:,.0f}",
        _percent(row["mfu"]),
        _percent(step["bubble_s"] / step["total_s"]),
        _percent(step["exchange_s"] / step["total_s"]),
        f"{row['gpu_hours']:,.0f}",
        f"{row['days']:.1f}",
    ]


def _assert_fields(shown: list[list[str]], row: dict) -> None:
    """The page's table of every field of a layout holds `row` (from `plan --json`)."""

    def flat(value, prefix: str):
        if isinstance(value, dict):
            for k, v in value.items():
                yield from flat(v, f"{prefix}.{k}" if prefix else k)
        else:
            yield prefix, value

    expected = dict(flat(row, ""))
    assert [name for name, _ in shown] == list(expected)
    for name, text in shown:
        value = expected[name]
        if isinstance(value, bool) or value is None:
            assert text == json.dumps(value), name
        elif isinstance(value, int | float):
            assert float(text) == value, name
        else:
            assert text == (" ".join(value) if isinstance(value, list) else value), name


@pytest.mark.slow
def test_the_page_in_chromium_shows_the_clis_figures_and_its_config_trains(tmp_path, capsys):
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)")
    sync_api = pytest.importorskip("playwright.sync_api")
    pytest.importorskip("moe_train")  # trains the config the page downloads
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moe_plan",
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
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            page = browser.new_page(accept_downloads=True, viewport={"width": 1280, "height": 900})
            page.goto(address)
            page.wait_for_selector("body[data-planned]", timeout=120_000)
            # It opens on the config and devices the server names, the config's own layout
            # chosen: it starts there.
            assert OPENING_CONFIG == "olmoe-1b-7b.yaml"
            assert page.input_value("#config") == OPENING_CONFIG
            assert "--gpus=8" in page.text_content("#command")
            olmoe = load_config(ROOT / "configs/olmoe-1b-7b.yaml")
            assert page.text_content("#chosen") == layout_label(olmoe, 8)
            assert page.input_value("#num_experts") == str(olmoe.model.moe.num_experts)
            assert page.input_value("#d_model") == str(olmoe.model.d_model)
            assert "--model." not in page.text_content("#command")  # the config's own values
            page.fill("#gpus", "64")
            page.fill("#num_experts", "32")
            page.wait_for_function(
                "document.querySelector('#command').textContent.includes('--gpus=64 ') && "
                "document.querySelector('#command').textContent.includes('num_experts=32') && "
                "!document.body.classList.contains('busy')",
                timeout=120_000,
            )
            command = page.text_content("#command").split()
            assert command[:2] == ["moe-plan", "configs/olmoe-1b-7b.yaml"]
            _, out, _ = _cli([str(ROOT / command[1]), *command[2:]], capsys)
            cli = json.loads(out)
            assert cli["world_size"] == 64
            assert _shown_rows(page, "own") == [_cells(cli["own"], 1)]
            shown = _shown_rows(page, "fitting")
            assert shown == [_cells(r, i) for i, r in enumerate(cli["fitting"][:25], 1)]
            page.click("#more-fitting")  # the next rows, asked for
            page.wait_for_selector("body[data-rows='50']", timeout=60_000)
            shown = _shown_rows(page, "fitting")
            assert shown == [_cells(r, i) for i, r in enumerate(cli["fitting"][:50], 1)]
            # A rejected layout's full figures, asked for by clicking its summary.
            over = next(r for r in cli["rejected"][:REJECTED_SHOWN] if r["starts"])
            page.click("#rejected-details summary")
            page.click(f"#rejected tbody tr[data-layout='{over['layout']}']")
            page.wait_for_selector(f"#figures[data-layout='{over['layout']}']", timeout=60_000)
            assert page.text_content("#chosen") == over["layout"]
            _assert_fields(_shown_rows(page, "fields"), over)
            page.click("#fitting tbody tr:nth-child(2)")
            chosen = cli["fitting"][1]
            assert page.text_content("#chosen") == chosen["layout"]
            # The experts field lost its focus above ("change" with nothing changed): the
            # page must not plan again and take the chosen layout and the extra rows away.
            page.wait_for_timeout(1500)
            assert page.text_content("#chosen") == chosen["layout"]
            assert len(_shown_rows(page, "fitting")) > 25
            with page.expect_download() as download:
                page.click("#download")
            path = tmp_path / "chosen.yaml"
            download.value.save_as(path)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    config = load_config(path)
    assert layout_label(config, 64) == chosen["layout"]
    assert config.model.moe.num_experts == 32
    tiny = [
        "--model.vocab_size=320",
        "--model.d_model=64",
        "--model.n_layers=2",
        "--model.n_heads=4",
        "--model.n_kv_heads=2",
        "--model.moe.num_experts=4",
        "--model.moe.top_k=2",
        "--model.moe.expert_hidden=64",
        "--data.seq_len=32",
        "--data.global_batch_size=4",
        "--data.micro_batch_size=2",
        "--data.paths=[builtin:stdlib]",
        "--parallel.pp=1",
        "--parallel.ep=1",
        "--train.max_steps=2",
        f"--train.run_dir={tmp_path / 'run'}",
    ]
    from moe_train.cli import main as moe_train

    capsys.readouterr()
    assert moe_train(["train", str(path), *tiny]) == 0, capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (tmp_path / "run/metrics.jsonl").open()]
    assert steps[-1] == 2
    assert yaml.safe_load(path.read_text())["model"]["moe"]["num_experts"] == 32

// The planner's page: reads the inputs, asks the server (which runs `moe-plan --json`),
// and draws its answer. No figure is computed here; the page only formats and arranges them.
// The answer carries the first rows of each list (rejected layouts as summaries); more rows,
// and a rejected layout's full figures, are asked for when wanted (/api/rows, /api/layout).
"use strict";

const KNOBS = [["n_layers", "layers"], ["d_model", "width (d_model)"], ["num_experts", "experts"],
  ["top_k", "top-k"], ["expert_hidden", "expert width"], ["seq_len", "sequence length"],
  ["vocab_size", "vocabulary"]];
// Their first values, and the config the page opens on, come from the server (/api/configs).
const DEVICE_FIELDS = [["gpus", "GPUs"], ["gpus_per_node", "GPUs per node"], ["tokens", "token budget"]];
const GPUS = ["h100", "h200", "b200", "b300"];
const COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
  "#ff9da7", "#9c755f", "#bab0ac"];
const MORE_ROWS = 25, MORE_REJECTED = 200;
const $ = (id) => document.getElementById(id);
let answer = null, chosen = null, timer = null, sequence = 0;
let planned = null;  // the last request planned, as sent: the same inputs again change nothing

function field(name, label, value, placeholder) {
  const wrap = document.createElement("label");
  wrap.textContent = label;
  const input = document.createElement("input");
  input.id = name; input.type = "text"; input.value = value || ""; input.placeholder = placeholder || "";
  const error = document.createElement("span");
  error.className = "error"; error.id = "err-" + name;
  wrap.append(input, error);
  return wrap;
}

function buildInputs() {
  for (const [name, label] of KNOBS) $("knobs").append(field(name, label, "", "the config's"));
  const gpu = document.createElement("label");
  gpu.textContent = "GPU kind";
  const select = document.createElement("select");
  select.id = "gpu";
  for (const g of GPUS) select.append(new Option(g, g));
  const error = document.createElement("span");
  error.className = "error"; error.id = "err-gpu";
  gpu.append(select, error);
  $("devices").append(gpu);
  for (const [name, label] of DEVICE_FIELDS) $("devices").append(field(name, label));
}

function request(extra) {
  const r = {};
  if (document.querySelector("input[name=source]:checked").value === "yaml") r.yaml = $("yaml").value;
  else r.config = $("config").value;
  // A model input that still shows the config's own value is left out (the config has it).
  for (const [name] of KNOBS) if ($(name).value.trim() !== $(name).dataset.config) r[name] = $(name).value;
  for (const [name] of [...DEVICE_FIELDS, ["gpu"]]) r[name] = $(name).value;
  return Object.assign(r, extra || {});
}

async function post(path, body) {
  const response = await fetch(path, {method: "POST", body: JSON.stringify(body),
    headers: {"Content-Type": "application/json"}});
  return response;
}

function showErrors(errors) {
  for (const el of document.querySelectorAll(".error")) el.textContent = "";
  for (const el of document.querySelectorAll(".bad")) el.classList.remove("bad");
  for (const [name, message] of Object.entries(errors || {})) {
    const slot = $("err-" + name) || $("err-request");
    slot.textContent = message;
    if ($(name)) $(name).classList.add("bad");
  }
}

async function plan(extra) {
  const mine = ++sequence;
  const body = request(extra);
  planned = JSON.stringify(body);
  document.body.classList.add("busy");
  let data;
  try {
    const response = await post("/api/plan", body);
    data = await response.json();
  } catch (e) {
    data = {errors: {request: "the server did not answer: " + e}};
  }
  if (mine !== sequence) return;  // a later request is on its way
  document.body.classList.remove("busy");
  showErrors(data.errors);
  $("command").textContent = data.argv ? data.argv.join(" ") : "";
  answer = data.plan || null;
  $("out").hidden = !answer;
  if (!answer) return;
  const first = answer.fitting[0] || (answer.smallest_fitting || {}).layout;
  choose(answer.own.starts ? answer.own : first || answer.own);
  drawRows();
  document.body.dataset.planned = String(mine);
}

const gib = 2 ** 30;
function bytes(n) {
  for (const [unit, size] of [["GiB", gib], ["MiB", 2 ** 20], ["KiB", 1024]])
    if (n >= size) return (n / size).toFixed(1) + " " + unit;
  return n.toFixed(0) + " B";
}
const count = (x) => Math.round(x).toLocaleString("en-US");
const percent = (x) => (x > 0 && x < 0.0005) ? "<0.1%" : (100 * x).toFixed(1) + "%";
const gb = (x) => (x / 1e9).toFixed(2) + " GB";

function figures(row) {
  if (!row.starts) return [["cannot start", row.reason]];
  const step = row.step_s;
  const out = [["memory per device", bytes(row.memory_bytes.total) + (row.fits ? " (fits)" : " (does NOT fit)")],
    ["tokens/s per device", count(row.tokens_per_s_per_device)],
    ["MFU", percent(row.mfu)],
    ["step", step.total_s.toFixed(3) + " s"],
    ["bubble", percent(step.bubble_s / step.total_s)],
    ["expert exchange", percent(step.exchange_s / step.total_s)]];
  if (row.gpu_hours !== undefined) {
    out.push(["GPU-hours to " + Number(answer.tokens).toExponential(2) + " tokens", count(row.gpu_hours)]);
    out.push(["days on " + row.world_size + " GPUs", row.days.toFixed(1)]);
  }
  return out;
}

function table(el, head, rows) {
  el.replaceChildren();
  if (head) {
    const tr = el.createTHead().insertRow();
    head.forEach((h, i) => { const th = document.createElement("th"); th.textContent = h;
      if (i < 2) th.className = "text"; tr.append(th); });
  }
  const body = el.createTBody();
  for (const cells of rows) {
    const tr = body.insertRow();
    cells.forEach((c, i) => { const td = tr.insertCell(); td.textContent = c;
      if (i < (head ? 2 : 1)) td.className = "text"; });
  }
  return body;
}

function choose(row) {
  chosen = row;
  $("chosen").textContent = row.layout + (row.world_size !== answer.world_size ? ` on ${row.world_size} GPUs` : "");
  table($("figures"), null, figures(row));
  $("figures").dataset.layout = row.layout;
  drawChart(row);
  const kinds = Object.keys(row.wire_bytes_per_step || {});
  table($("traffic"), ["kind", "", "sent", "across nodes", "calls"], kinds.map((k) => [k, "",
    gb(row.wire_bytes_per_step[k]), gb((row.across_nodes_bytes_per_step || {})[k] || 0),
    String((row.collective_calls_per_step || {})[k] ?? "")]));
  table($("fields"), null, flatten(row, ""));
  for (const tr of document.querySelectorAll("tr.chosen")) tr.classList.remove("chosen");
  for (const tr of document.querySelectorAll("table.rows tbody tr"))
    if (tr.dataset.layout === row.layout) tr.classList.add("chosen");
}

function flatten(value, prefix) {
  if (value !== null && typeof value === "object" && !Array.isArray(value))
    return Object.entries(value).flatMap(([k, v]) => flatten(v, prefix ? prefix + "." + k : k));
  return [[prefix, Array.isArray(value) ? value.join(" ") : String(value)]];
}

const ROW_HEAD = ["#", "layout", "memory", "tok/s/dev", "MFU", "bubble", "exch.", "GPU-hours", "days"];
function rowCells(row, i) {
  if (!row.starts) return [String(i), row.layout, row.reason];
  const step = row.step_s;
  const cells = [String(i), row.layout, bytes(row.memory_bytes.total), count(row.tokens_per_s_per_device),
    percent(row.mfu), percent(step.bubble_s / step.total_s), percent(step.exchange_s / step.total_s)];
  if (row.gpu_hours !== undefined) cells.push(count(row.gpu_hours), row.days.toFixed(1));
  if (!row.fits) cells.push(row.reason);
  return cells;
}

function rows(el, list, head) {
  const body = table(el, head, list.map((r, i) => rowCells(r, i + 1)));
  [...body.rows].forEach((tr, i) => { tr.dataset.layout = list[i].layout;
    if (list[i].starts) tr.onclick = () => choose(list[i]); });
}

function drawRows() {
  const head = answer.tokens ? ROW_HEAD : ROW_HEAD.slice(0, 7);
  rows($("own"), [answer.own], head);
  const fitting = answer.fitting.length ? answer.fitting : (answer.closest || []);
  $("fitting-title").textContent = answer.fitting_count
    ? `Layouts that fit (${answer.fitting_count}), fastest first` + (fitting.length < answer.fitting_count ? `; the first ${fitting.length}` : "")
    : `No layout fits ${answer.device.memory_gib} GiB per device; the closest, least memory first`;
  const shown = [...fitting];
  const best = (answer.smallest_fitting || {}).layout;
  if (best) shown.push(best);
  rows($("fitting"), shown, head);
  $("more-fitting").hidden = answer.fitting.length >= answer.fitting_count;
  $("rejected-title").textContent = `Layouts that do not fit or cannot start (${answer.rejected_count})`;
  $("groups").replaceChildren(...answer.rejected_groups.map((g) => {
    const li = document.createElement("li"); li.textContent = `${g.count}: ${g.reason}`; return li; }));
  drawRejected();
  table($("legend"), null, [...Object.entries(answer.legend),
    ...flatten(answer.device, "device")]);
}

// Rejected layouts come as summaries; clicking one that starts asks for its full figures.
function drawRejected() {
  const body = table($("rejected"), ["#", "layout", "memory", "over", "largest part", "why"],
    answer.rejected.map((r, i) => [String(i + 1), r.layout,
      r.starts ? bytes(r.memory_total_bytes) : "", r.starts ? "+" + bytes(r.over_bytes) : "",
      r.largest_part || "", r.reason]));
  [...body.rows].forEach((tr, i) => { const r = answer.rejected[i]; tr.dataset.layout = r.layout;
    if (r.starts) tr.onclick = () => details(r.layout); });
  $("rejected-shown").textContent = answer.rejected.length < answer.rejected_count
    ? `the first ${answer.rejected.length}` : "";
  $("more-rejected").hidden = answer.rejected.length >= answer.rejected_count;
}

async function details(layout) {
  const response = await post("/api/layout", request({layout}));
  const data = await response.json();
  if (!response.ok) { showErrors(data.errors); return; }
  choose(data.layout);
}

async function more(list, count) {
  const mine = answer;
  const response = await post("/api/rows", request({list, start: mine[list].length, count}));
  const data = await response.json();
  if (!response.ok) { showErrors(data.errors); return; }
  if (mine !== answer) return;  // the inputs changed meanwhile
  mine[list].push(...data.rows);
  drawRows();
  choose(chosen);
  document.body.dataset.rows = String(mine[list].length);
}

function drawChart(selected) {
  const ns = "http://www.w3.org/2000/svg";
  const bars = [selected, answer.own, ...answer.fitting.slice(0, 8)]
    .filter((r, i, all) => r.starts && all.findIndex((s) => s.layout === r.layout) === i);
  const categories = [...new Set(bars.flatMap((r) => Object.keys(r.memory_bytes)))].filter((c) => c !== "total");
  const limit = answer.device.memory_gib * gib;
  const top = Math.max(limit, ...bars.map((r) => r.memory_bytes.total));
  const W = 1100, barH = 22, left = 420, H = bars.length * (barH + 6) + 50;
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", W); svg.setAttribute("height", H);
  const add = (tag, attrs, text) => { const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text; svg.append(e); return e; };
  const scale = (W - left - 80) / top;
  bars.forEach((r, i) => {
    const y = 10 + i * (barH + 6);
    add("text", {x: left - 6, y: y + 15, "text-anchor": "end"}, (r === selected ? "▶ " : "") + r.layout);
    let x = left;
    categories.forEach((c, j) => { const w = (r.memory_bytes[c] || 0) * scale;
      add("rect", {x, y, width: Math.max(w, 0), height: barH, fill: COLORS[j % COLORS.length]})
        .append(Object.assign(document.createElementNS(ns, "title"), {textContent: `${c}: ${bytes(r.memory_bytes[c] || 0)}`}));
      x += w; });
    add("text", {x: x + 4, y: y + 15}, bytes(r.memory_bytes.total));
  });
  const lx = left + limit * scale, bottom = 10 + bars.length * (barH + 6);
  add("line", {x1: lx, x2: lx, y1: 4, y2: bottom, stroke: "#000", "stroke-dasharray": "4 3"});
  add("text", {x: lx, y: bottom + 12, "text-anchor": "end"}, `device memory ${bytes(limit)}`);
  let x = left;
  categories.forEach((c, j) => { add("rect", {x, y: bottom + 22, width: 10, height: 10, fill: COLORS[j % COLORS.length]});
    add("text", {x: x + 14, y: bottom + 31}, c); x += 14 + 8 * c.length + 16; });
  $("chart").replaceChildren(svg);
}

async function download() {
  const response = await post("/api/config", request({overrides: chosen.overrides}));
  if (!response.ok) { showErrors((await response.json()).errors); return; }
  const blob = await response.blob();
  const a = document.createElement("a");
  const base = request().config ? request().config.replace(/\.yaml$/, "") : "pasted";
  a.href = URL.createObjectURL(blob);
  a.download = `${base}-${chosen.layout.replaceAll(" ", "_").replaceAll(":", "-")}.yaml`;
  document.body.append(a); a.click(); a.remove();
}

// The model inputs show the chosen config's own values, as the server reads them from it.
async function fillInputs() {
  const body = request();
  const response = await post("/api/inputs", {config: body.config, yaml: body.yaml});
  const values = response.ok ? (await response.json()).inputs : {};
  for (const [name] of KNOBS) {
    if (values[name] === undefined) { delete $(name).dataset.config; continue; }
    $(name).value = values[name]; $(name).dataset.config = values[name];
  }
}

async function start() {
  buildInputs();
  const listed = await (await fetch("/api/configs")).json();
  for (const name of listed.configs) $("config").append(new Option(name, name));
  if (listed.opening) $("config").value = listed.opening;
  for (const [name, value] of Object.entries(listed.devices)) $(name).value = value;
  if (!listed.configs.length) {
    document.querySelector("input[value=yaml]").checked = true;
    $("configs-note").textContent = listed.note;
  }
  const later = (refill) => { clearTimeout(timer);
    timer = setTimeout(async () => {
      if (refill) await fillInputs();
      // A field that loses focus fires "change" with nothing changed: keep the rows and
      // the chosen layout the person has.
      else if (JSON.stringify(request()) === planned) return;
      plan();
    }, 300); };
  const source = (e) => ["config", "yaml"].includes(e.target.id) || e.target.name === "source";
  $("inputs").addEventListener("input", (e) => later(source(e)));
  $("inputs").addEventListener("change", (e) => later(source(e)));
  $("search").onclick = () => plan({search: true});
  $("download").onclick = download;
  $("more-fitting").onclick = () => more("fitting", MORE_ROWS);
  $("more-rejected").onclick = () => more("rejected", MORE_REJECTED);
  await fillInputs();
  plan();
}
start();

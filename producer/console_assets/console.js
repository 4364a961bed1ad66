// inferq operator console. Every value from the gateway is written as text (text nodes, never
// innerHTML): a model name or a payload holding markup is shown, not run.
"use strict";

const REFRESH_MS = 3000;
const VIEWS = {};
const state = { token: sessionStorage.getItem("inferq-console-token") || "", role: null,
  view: "overview", timer: null, history: {}, jobs: { model: "", status: "", cursor: null,
  trail: [] }, job: null };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "on") { for (const [ev, fn] of Object.entries(value)) node.addEventListener(ev, fn); }
    else if (value !== null && value !== undefined && value !== false) node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function table(headers, rows, attrs) {
  return el("table", attrs || {}, el("thead", {}, el("tr", {}, headers.map(h => el("th", {}, h)))),
    el("tbody", {}, rows));
}

function ms(value) {
  if (value === null || value === undefined) return "-";
  if (value < 1000) return `${Math.round(value)} ms`;
  if (value < 60000) return `${(value / 1000).toFixed(1)} s`;
  return `${Math.floor(value / 60000)} m ${Math.round((value % 60000) / 1000)} s`;
}

function num(value, digits) {
  if (value === null || value === undefined) return "-";
  return digits === undefined ? String(value) : Number(value).toFixed(digits);
}

function mib(bytes) {
  if (!bytes) return "-";
  return bytes < 1024 * 1048576 ? `${(bytes / 1048576).toFixed(0)} MiB` : `${(bytes / 1073741824).toFixed(2)} GiB`;
}

function when(stamp) { return stamp ? new Date(stamp).toISOString().replace("T", " ").slice(0, 23) : "-"; }

class ApiError extends Error {
  constructor(status, message, redisDown) { super(message); this.status = status; this.redisDown = redisDown; }
}

async function api(path, options) {
  const init = Object.assign({ headers: {} }, options || {});
  init.headers = Object.assign({ authorization: `Bearer ${state.token}` }, init.headers);
  const response = await fetch(path, init);
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  if (!response.ok) {
    throw new ApiError(response.status, (body && body.error) || `HTTP ${response.status}`,
      Boolean(body && body.redis_down));
  }
  return body;
}

function banner(message) {
  const node = document.getElementById("banner");
  node.hidden = !message;
  node.textContent = message || "";
}

function show(...nodes) {
  const view = document.getElementById("view");
  view.replaceChildren(...nodes);
}

// -- login ---------------------------------------------------------------------------------

async function signIn(token) {
  state.token = token;
  const who = await api("console/api/whoami");
  state.role = who.role;
  sessionStorage.setItem("inferq-console-token", token);
  document.getElementById("login").hidden = true;
  document.getElementById("tabs").hidden = false;
  document.getElementById("logout").hidden = false;
  document.getElementById("who").textContent =
    `${who.role === "admin" ? "admin" : "read-only"} · namespace ${who.namespace}`;
  select(state.view);
}

function signOut(message) {
  sessionStorage.removeItem("inferq-console-token");
  state.token = ""; state.role = null;
  clearInterval(state.timer);
  document.getElementById("login").hidden = false;
  document.getElementById("tabs").hidden = true;
  document.getElementById("logout").hidden = true;
  document.getElementById("who").textContent = "";
  document.getElementById("login-error").textContent = message || "";
  show();
}

document.getElementById("login").addEventListener("submit", async (event) => {
  event.preventDefault();
  try { await signIn(document.getElementById("token").value); }
  catch (e) { signOut(`refused: ${e.message}`); }
});
document.getElementById("logout").addEventListener("click", () => signOut(""));
for (const button of document.querySelectorAll("#tabs button")) {
  button.addEventListener("click", () => select(button.dataset.view));
}

function select(view) {
  state.view = view;
  state.job = null;
  for (const button of document.querySelectorAll("#tabs button")) {
    button.classList.toggle("active", button.dataset.view === view);
  }
  clearInterval(state.timer);
  refresh();
  state.timer = setInterval(() => refresh(true), REFRESH_MS);
}

async function refresh(auto) {
  const focused = document.activeElement;
  if (auto && focused && focused.closest("#view") && focused.matches("input, select")) return;  // typing
  const render = VIEWS[state.view];
  try {
    await render();
    banner("");
  } catch (e) {
    if (e.status === 401 || e.status === 403) { signOut(`refused: ${e.message}`); return; }
    banner(e.redisDown ? `${e.message}; showing the last data` : e.message);
  }
}

function canAct() { return state.role === "admin"; }

async function act(what, fn) {
  try { await fn(); banner(""); }
  catch (e) { banner(`${what} failed: ${e.message}`); }
  refresh();
}

// -- overview ------------------------------------------------------------------------------

function spark(values) {
  const width = 120, height = 24;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("class", "spark"); svg.setAttribute("width", width); svg.setAttribute("height", height);
  const top = Math.max(1, ...values);
  const points = values.map((v, i) =>
    `${(i * width / Math.max(1, values.length - 1)).toFixed(1)},${(height - 2 - v * (height - 4) / top).toFixed(1)}`);
  const line = document.createElementNS(ns, "polyline");
  line.setAttribute("points", points.join(" ")); line.setAttribute("fill", "none");
  line.setAttribute("stroke", "#2f6fd6"); line.setAttribute("stroke-width", "1.5");
  svg.append(line);
  return svg;
}

VIEWS.overview = async function () {
  const doc = await api("console/api/overview");
  const nodes = [el("h2", {}, "Overview")];
  for (const warning of doc.warnings) nodes.push(el("div", { class: "warning" }, warning));
  const rows = [];
  for (const m of doc.models) {
    const total = m.backlog ? m.backlog.backlog : 0;
    const history = state.history[m.name] = (state.history[m.name] || []).concat([total]).slice(-40);
    rows.push(el("tr", { "data-model": m.name },
      el("td", { class: "model-name" }, m.name),
      el("td", {}, m.ready ? "ready" : "not ready"),
      el("td", { class: "num workers" }, m.workers),
      el("td", { class: "num backlog" }, total),
      el("td", { class: "num" }, m.backlog ? m.backlog.lag : "-"),
      el("td", { class: "num" }, m.backlog ? m.backlog.pending : "-"),
      el("td", { class: "num" }, m.backlog ? ms(m.backlog.oldest_pending_ms) : "-"),
      el("td", { class: "num" }, m.dead_letters),
      el("td", {}, spark(history))));
  }
  nodes.push(table(["model", "state", "workers", "backlog", "lag", "pending", "oldest wait",
    "dead letters", "backlog (recent)"], rows, { id: "models-overview" }));
  const versions = [];
  for (const m of doc.models) {
    for (const v of m.versions) {
      versions.push(el("tr", { "data-model": m.name, "data-version": v.version },
        el("td", {}, m.name), el("td", {}, v.version),
        el("td", { class: "num share" }, `${Math.round(v.share * 100)}%`),
        el("td", { class: "num" }, num(v.inferences_per_s, 1)),
        el("td", { class: "num" }, num(v.batches_per_s, 1)),
        el("td", { class: "num" }, v.error_rate === null || v.error_rate === undefined ? "-" : `${(v.error_rate * 100).toFixed(1)}%`),
        el("td", { class: "num" }, num(v.mean_ms, 1)),
        el("td", { class: "num" }, num(v.gateway_requests_per_s, 1)),
        el("td", { class: "num" }, num(v.p50_ms, 1)),
        el("td", { class: "num" }, num(v.p95_ms, 1)),
        el("td", { class: "num" }, num(v.p99_ms, 1))));
    }
  }
  nodes.push(el("h2", {}, "Versions and traffic"));
  nodes.push(table(["model", "version", "traffic share", "rows/s", "batches/s", "error rate",
    "mean on worker (ms)", "req/s here", "p50 ms", "p95 ms", "p99 ms"], versions, { id: "versions" }));
  const lanes = [];
  for (const m of doc.models) {
    for (const l of m.lanes) {
      lanes.push(el("tr", {}, el("td", {}, m.name), el("td", {}, l.lane), el("td", { class: "num" }, l.partition),
        el("td", { class: "num" }, l.length), el("td", { class: "num" }, l.lag),
        el("td", { class: "num" }, l.pending), el("td", { class: "num" }, l.consumers),
        el("td", { class: "num" }, ms(l.oldest_pending_ms))));
    }
  }
  nodes.push(el("h2", {}, "Backlog per lane and partition"));
  nodes.push(table(["model", "lane", "partition", "length", "lag", "pending", "consumers", "oldest wait"], lanes));
  nodes.push(el("p", { class: "muted" }, `sampled ${when(doc.sampled_ms)} (Redis clock); rates since the previous refresh; ` +
    "p50/p95/p99 and req/s are this gateway's, the rest every worker's"));
  show(...nodes);
};

// -- workers -------------------------------------------------------------------------------

VIEWS.workers = async function () {
  const doc = await api("console/api/workers");
  const rows = doc.workers.map(w => el("tr", { "data-worker": w.id, class: w.live ? "live" : "gone" },
    el("td", {}, w.id), el("td", {}, w.live ? "live" : "gone"), el("td", {}, w.host || "-"),
    el("td", { class: "num" }, w.pid || "-"),
    el("td", { class: "num" }, w.started_ms ? ms(doc.now_ms - w.started_ms) : "-"),
    el("td", { class: "num" }, w.heartbeat_expires_in_ms > 0 ? `in ${ms(w.heartbeat_expires_in_ms)}` : `${ms(-w.heartbeat_expires_in_ms)} ago`),
    el("td", {}, w.models.map(m => `${m.name} (${m.versions.join(", ") || "unloaded"})`).join("; ")),
    el("td", { class: "num in-flight" }, w.in_flight),
    el("td", { class: "num" }, num(w.batches_per_s, 1)),
    el("td", { class: "num restarts" }, num(w.restarts)),
    el("td", { class: "num memory" }, w.resident_bytes ? mib(w.resident_bytes) : "-")));
  show(el("h2", {}, "Workers"),
    table(["worker", "state", "host", "pid", "up for", "heartbeat expires", "models", "in flight", "batches/s", "restarts", "memory"], rows, { id: "workers" }),
    el("p", { class: "muted" }, "In flight: requests read and not yet acknowledged. Restarts: how often inferq up restarted the worker's slot. Memory: its resident set at its last heartbeat."));
};

// -- jobs ----------------------------------------------------------------------------------

VIEWS.jobs = async function () {
  if (state.job) return renderJob(state.job);
  const j = state.jobs;
  const query = new URLSearchParams({ limit: "25" });
  if (j.model) query.set("model", j.model);
  if (j.status) query.set("status", j.status);
  if (j.cursor) query.set("cursor", j.cursor);
  const doc = await api(`console/api/jobs?${query}`);
  const model = el("input", { id: "job-model", placeholder: "model", value: j.model });
  const status = el("select", { id: "job-status" }, ["", "queued", "running", "succeeded", "failed", "expired", "cancelled"]
    .map(s => el("option", { value: s, selected: s === j.status ? "selected" : null }, s || "any status")));
  const apply = el("button", { id: "job-filter", on: { click: () => {
    j.model = model.value.trim(); j.status = status.value; j.cursor = null; j.trail = []; refresh(); } } }, "Filter");
  const rows = doc.jobs.map(r => el("tr", { "data-job": r.id, class: `job ${r.status}` },
    el("td", {}, el("a", { href: "#", class: "job-link", on: { click: (e) => { e.preventDefault(); state.job = r.id; refresh(); } } }, r.id)),
    el("td", {}, r.model), el("td", {}, r.version), el("td", { class: "status" }, r.status),
    el("td", {}, when(r.created_ms)), el("td", {}, r.error)));
  const older = el("button", { id: "job-older", disabled: doc.cursor ? null : "disabled", on: { click: () => {
    j.trail.push(j.cursor); j.cursor = doc.cursor; refresh(); } } }, "Older");
  const newer = el("button", { disabled: j.trail.length ? null : "disabled", on: { click: () => {
    j.cursor = j.trail.pop(); refresh(); } } }, "Newer");
  show(el("h2", {}, "Jobs"), el("div", { class: "filters" }, model, status, apply),
    table(["job", "model", "version", "status", "created", "error"], rows, { id: "jobs" }),
    el("div", { class: "filters" }, newer, older,
      el("span", { class: "muted" }, `${doc.indexed} jobs indexed (the newest only); ${doc.scanned} scanned for this page`)));
};

async function renderJob(id) {
  const doc = await api(`console/api/jobs/${encodeURIComponent(id)}`);
  const job = doc.job;
  const back = el("button", { on: { click: () => { state.job = null; refresh(); } } }, "Back to the list");
  const cancel = el("button", { id: "job-cancel", class: "act", disabled: canAct() && job.status === "queued" ? null : "disabled",
    on: { click: () => act("cancel", () => api(`v2/jobs/${encodeURIComponent(id)}`, { method: "DELETE" })) } }, "Cancel");
  const t = doc.times;
  show(el("h2", {}, `Job ${job.id}`), el("div", { class: "filters" }, back, cancel),
    table(["model", "version", "status", "queued", "started", "finished", "deadline"], [el("tr", {},
      el("td", {}, job.model_name), el("td", {}, job.model_version), el("td", { id: "job-status-value" }, job.status),
      el("td", {}, when(t.queued_ms)), el("td", {}, t.started_ms ? `${when(t.started_ms)} (+${ms(t.started_ms - t.queued_ms)})` : "-"),
      el("td", {}, t.finished_ms ? `${when(t.finished_ms)} (+${ms(t.finished_ms - t.queued_ms)})` : "-"),
      el("td", {}, when(t.deadline_ms)))]),
    el("h2", {}, "Events"), el("ol", { id: "job-events" }, doc.events.map(e => el("li", {}, e.status))),
    job.error ? el("div", {}, el("h2", {}, "Error"), el("pre", { id: "job-error" }, job.error)) : null,
    job.result ? el("div", {}, el("h2", {}, "Result"), el("pre", {}, JSON.stringify(job.result, null, 2))) : null,
    el("h2", {}, "Record"), el("pre", {}, JSON.stringify(job, null, 2)));
}

// -- batches -------------------------------------------------------------------------------

VIEWS.batches = async function () {
  // The public batch API (/v2/batches), newest first: progress, counts, the output and error
  // downloads, and cancel (admin token, a POST like every action).
  const doc = await api("v2/batches?limit=25");
  const rows = doc.data.map(b => {
    const c = b.request_counts;
    const done = c.completed + c.failed;
    const cancel = el("button", { class: "act batch-cancel",
      disabled: canAct() && ["validating", "in_progress"].includes(b.status) ? null : "disabled",
      on: { click: () => act("cancel", () => api(`v2/batches/${encodeURIComponent(b.id)}/cancel`, { method: "POST" })) } },
      "Cancel");
    return el("tr", { "data-batch": b.id, class: `batch ${b.status}` },
      el("td", {}, b.id), el("td", {}, b.model || "-"), el("td", { class: "status" }, b.status),
      el("td", {}, el("progress", { max: String(c.total || 1), value: String(done) }),
        ` ${done} / ${c.total}`),
      el("td", { class: "num" }, num(c.completed)), el("td", { class: "num" }, num(c.failed)),
      el("td", {}, b.created_at || "-"),
      el("td", {}, el("a", { href: `v2/batches/${encodeURIComponent(b.id)}/output`, download: `${b.id}-output.jsonl` }, "output"),
        " ", el("a", { href: `v2/batches/${encodeURIComponent(b.id)}/errors`, download: `${b.id}-errors.jsonl` }, "errors")),
      el("td", {}, cancel));
  });
  show(el("h2", {}, "Batches"),
    rows.length ? table(["batch", "model", "status", "progress", "completed", "failed", "created", "download", ""], rows, { id: "batches" })
      : el("p", { id: "no-batches" }, "No batches."),
    doc.has_more ? el("p", { class: "muted" }, "The 25 newest are shown; `inferq batch status` or GET /v2/batches pages through the rest.") : null);
};

// -- dead letters --------------------------------------------------------------------------

VIEWS.deadletters = async function () {
  const doc = await api("console/api/deadletters");
  const nodes = [el("h2", {}, "Dead letters")];
  if (!doc.models.length) nodes.push(el("p", { id: "no-dead-letters" }, "No dead letters."));
  for (const m of doc.models) {
    const base = `console/api/deadletters/${encodeURIComponent(m.model)}`;
    const post = (what, body) => act(what, () => api(`${base}/${what}`, { method: "POST",
      headers: { "content-type": "application/json" }, body: JSON.stringify(body) }));
    const disabled = canAct() ? null : "disabled";
    nodes.push(el("h2", {}, `${m.model}: ${m.total}`),
      el("div", { class: "filters" },
        el("button", { class: "act dlq-retry-all", disabled, on: { click: () => post("retry", { all: true }) } }, "Retry all"),
        el("button", { class: "act dlq-purge-all", disabled, on: { click: () => {
          if (confirm(`Delete every dead letter of ${m.model}?`)) post("purge", { all: true }); } } }, "Purge all")),
      table(["id", "request", "reason", "deliveries", "preview", ""], m.entries.map(e => el("tr", { "data-letter": e.id },
        el("td", {}, e.id), el("td", {}, e.request ? `${e.request.id} (${e.request.kind})` : "undecodable"),
        el("td", { class: "reason" }, e.undecodable ? `${e.reason}` : e.reason), el("td", { class: "num" }, e.deliveries),
        el("td", { class: "preview" }, e.preview),
        el("td", {}, el("button", { class: "act dlq-retry", disabled, on: { click: () => post("retry", { ids: [e.id] }) } }, "Retry"),
          el("button", { class: "act dlq-purge", disabled, on: { click: () => post("purge", { ids: [e.id] }) } }, "Purge")))),
      { class: "dlq" }));
  }
  show(...nodes);
};

// -- models --------------------------------------------------------------------------------

function load(model, parameters) {
  return act("load", () => api(`v2/repository/models/${encodeURIComponent(model)}/load`, { method: "POST",
    headers: { "content-type": "application/json" }, body: JSON.stringify({ parameters }) }));
}

VIEWS.models = async function () {
  const doc = await api("console/api/models");
  const names = [...new Set(doc.rows.map(r => r.name))];
  const disabled = canAct() ? null : "disabled";
  const nodes = [el("h2", {}, "Models"), table(["model", "version", "state", "traffic", "reason"],
    doc.rows.map(r => el("tr", { "data-model": r.name, "data-version": r.version || "" },
      el("td", {}, r.name), el("td", {}, r.version || "-"), el("td", {}, r.state),
      el("td", { class: "num" }, r.traffic === undefined ? "-" : `${Math.round(r.traffic * 100)}%`),
      el("td", {}, r.reason || ""))), { id: "model-rows" })];
  for (const name of names) {
    const versions = doc.available[name] || doc.rows.filter(r => r.name === name && r.version).map(r => r.version);
    const weights = el("input", { class: "weights", "data-model": name, placeholder: "weights, e.g. 1=90,2=10", size: "24" });
    const split = () => {
      const parsed = {};
      for (const part of weights.value.split(",")) {
        const [version, weight] = part.split("=").map(s => s.trim());
        if (version) parsed[version] = Number(weight);
      }
      load(name, { weights: parsed });
    };
    nodes.push(el("div", { class: "filters", "data-model": name }, el("strong", {}, name),
      versions.map(v => el("button", { class: "act switch", "data-version": v, disabled, on: { click: () => load(name, { version: v }) } }, `serve ${v} only`)),
      weights, el("button", { class: "act split", disabled, on: { click: split } }, "Set canary split"),
      el("button", { class: "act", disabled, on: { click: () => load(name, {}) } }, "Load (repository config)"),
      el("button", { class: "act", disabled, on: { click: () => {
        if (confirm(`Unload ${name}?`)) act("unload", () => api(`v2/repository/models/${encodeURIComponent(name)}/unload`, { method: "POST" })); } } }, "Unload")));
  }
  show(...nodes);
};

if (state.token) signIn(state.token).catch(e => signOut(`refused: ${e.message}`));

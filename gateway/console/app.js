/**
 * The web console: asks once for an API key (kept in this tab's sessionStorage, sent only as
 * `Authorization: Bearer` and, for terminals, as a WebSocket subprotocol), then shows the
 * tenant's sandboxes, templates with their bake progress, usage by day, a sandbox's live metrics,
 * and opens terminals.
 * Every value from the API is rendered as text (dom.js), never as markup.
 *
 * A sandboxes API key (demo, pro, enterprise) sees everything; fork needs pro or better. A sessions API key
 * (live, scale) has no sandboxes or usage in this API: the console lists its templates and says so.
 */
import { ApiError, apiFor, mapLimited } from "./api.js";
import { lastDays, metricsChart, mib, usageChart } from "./chart.js";
import { $, age, el, ms, replace } from "./dom.js";
import { openTerminal } from "./terminal.js";

const KEY_STORAGE = "sandboxd.console.key";
/** Days on the usage chart: two weeks fit the page's width at a readable bar size. */
const USAGE_DAYS = 14;
/** Detail calls (one per sandbox or template) in flight at once: well under the 100/s rate limit. */
const PARALLEL = 6;
/** The most sandboxes whose details (labels, age) are fetched; the rest show id, template, state. */
const DETAIL_MAX = 50;
/** How often the page reloads while a template bakes, ms: phases last seconds to minutes. */
const BAKE_POLL_MS = 2000;
const PHASES = ["Pending", "Converting", "Distributing", "Live"];
/** How often open metrics are read again, ms: the service samples every 2 s (docs/metrics.md). */
const METRICS_POLL_MS = 2000;

let api;
let key;
let terminal;
let bakePoll;
let metricsView;

function status(text, isError = false) {
  const node = $("status");
  node.textContent = text;
  node.classList.toggle("error", isError);
}

function errorText(err) {
  return err instanceof ApiError ? `${err.status} ${err.code}: ${err.message}` : String(err?.message ?? err);
}

function showLogin() {
  $("login").hidden = false;
  $("main").hidden = true;
  $("forget").hidden = true;
  $("refresh").hidden = true;
  $("whoami").textContent = "";
  $("key-input").focus();
}

async function start(k) {
  key = k;
  api = apiFor(k);
  $("login").hidden = true;
  $("main").hidden = false;
  $("forget").hidden = false;
  $("refresh").hidden = false;
  // A previous key's view (a sessions API key hides what it cannot see) does not carry over.
  $("notice").hidden = true;
  for (const id of ["sandboxes-section", "usage-section"]) $(id).hidden = false;
  // The key's tier is its second part (svc_<tier>_...), its secret the last: the rest is shown so
  // the user knows which key is in use (svc_<tier>[_<region>]_<id>).
  $("whoami").textContent = `${k.split("_")[1] ?? "?"} key ${k.split("_").slice(0, -1).join("_")}_…`;
  await refresh();
}

async function refresh() {
  status("Loading…");
  const results = await Promise.allSettled([loadSandboxes(), loadUsage(), loadTemplates()]);
  const failed = results.find((r) => r.status === "rejected");
  if (failed) {
    if (failed.reason instanceof ApiError && failed.reason.status === 401) {
      sessionStorage.removeItem(KEY_STORAGE);
      showLogin();
      status("The key was refused (401).", true);
      return;
    }
    status(errorText(failed.reason), true);
    return;
  }
  status(`Updated ${new Date().toLocaleTimeString()}`);
}

function sessionsApiNotice() {
  const n = $("notice");
  n.hidden = false;
  n.textContent =
    "This is a sessions API key (live or scale): sandboxes, usage, terminals into sandboxes, fork and " +
    "delete belong to sandboxes API keys (demo, pro, enterprise). Its templates are listed below.";
}

// ---- sandboxes -----------------------------------------------------------------------------

async function loadSandboxes() {
  let list;
  try {
    list = await api.get("/v1/sandboxes");
  } catch (err) {
    if (err instanceof ApiError && err.status === 403) {
      sessionsApiNotice();
      $("sandboxes-section").hidden = true;
      return;
    }
    throw err;
  }
  const rows = list.sandboxes;
  const details = await mapLimited(rows.slice(0, DETAIL_MAX), PARALLEL, (s) =>
    api.get(`/v1/sandboxes/${encodeURIComponent(s.id)}`).catch(() => undefined),
  );
  const body = $("sandboxes").querySelector("tbody");
  replace(body, ...rows.map((s, i) => sandboxRow(s, details[i])));
  $("sandboxes-empty").hidden = rows.length > 0;
}

function sandboxRow(s, info) {
  const labels = info
    ? Object.entries(info.labels)
        .map(([k, v]) => `${k}=${v}`)
        .join(", ")
    : "";
  const actions = el("td", { class: "actions" });
  if (s.state === "running") {
    actions.append(button("Terminal", () => showTerminal(s.id)));
  }
  actions.append(
    button("Metrics", () => showMetrics(s.id)),
    button("Fork", () =>
      act(`Forking ${s.id}`, () => api.post(`/v1/sandboxes/${encodeURIComponent(s.id)}/fork`, { count: 1 })),
    ),
    button(
      "Delete",
      () => {
        if (!confirm(`Delete sandbox ${s.id}?`)) return;
        if (terminal?.sandboxId === s.id) closeTerminal();
        if (metricsView?.sandboxId === s.id) closeMetrics();
        return act(`Deleting ${s.id}`, () => api.del(`/v1/sandboxes/${encodeURIComponent(s.id)}`));
      },
      "danger",
    ),
  );
  return el(
    "tr",
    { dataset: { sandbox: s.id } },
    el("td", { class: "id" }, s.id),
    el("td", {}, s.template),
    el("td", {}, el("span", { class: `state state-${s.state}` }, s.state)),
    el("td", { class: "labels" }, labels),
    el("td", {}, info ? age(info.age_secs) : ""),
    el("td", {}, info ? String(info.exec_count) : ""),
    actions,
  );
}

function button(text, onClick, cls) {
  const b = el("button", { type: "button", ...(cls ? { class: cls } : {}) }, text);
  b.addEventListener("click", () => onClick());
  return b;
}

async function act(what, fn) {
  status(`${what}…`);
  try {
    await fn();
  } catch (err) {
    status(`${what} failed: ${errorText(err)}`, true);
    return;
  }
  await refresh();
}

// ---- terminal ------------------------------------------------------------------------------

function showTerminal(sandboxId) {
  closeTerminal();
  $("terminal-section").hidden = false;
  $("terminal-title").textContent = sandboxId;
  const handle = openTerminal($("terminal"), {
    sandboxId,
    key,
    onEnd: (code) => status(`Terminal into ${sandboxId} closed (${code})`, code !== 1000),
  });
  terminal = { sandboxId, handle };
}

function closeTerminal() {
  terminal?.handle.close();
  terminal = undefined;
  $("terminal-section").hidden = true;
  $("terminal").replaceChildren();
}

// ---- live metrics --------------------------------------------------------------------------

/** Shows a sandbox's live metrics, read again every METRICS_POLL_MS until closed. */
function showMetrics(sandboxId) {
  closeMetrics();
  $("metrics-section").hidden = false;
  $("metrics-title").textContent = sandboxId;
  const view = { sandboxId, timer: undefined };
  metricsView = view;
  const load = async () => {
    let m;
    try {
      m = await api.get(`/v1/sandboxes/${encodeURIComponent(sandboxId)}/metrics`);
    } catch (err) {
      if (metricsView === view) $("metrics-now").textContent = `Metrics unavailable: ${errorText(err)}`;
      return;
    }
    if (metricsView !== view) return;
    const c = m.current;
    $("metrics-now").textContent = c
      ? `${m.state}: CPU ${c.cpu_percent ?? "–"}%, memory ${mib(c.memory_used_bytes)} of ${mib(m.memory_limit_bytes ?? 0)}, disk ${mib(c.disk_used_bytes)} (at ${c.at})`
      : `${m.state}: no samples yet`;
    replace($("metrics-chart"), metricsChart(m));
  };
  void load();
  view.timer = setInterval(load, METRICS_POLL_MS);
}

function closeMetrics() {
  if (metricsView) clearInterval(metricsView.timer);
  metricsView = undefined;
  $("metrics-section").hidden = true;
  $("metrics-chart").replaceChildren();
}

// ---- usage ---------------------------------------------------------------------------------

async function loadUsage() {
  const days = lastDays(USAGE_DAYS, Date.now());
  let totals;
  try {
    totals = await mapLimited(days, PARALLEL, (d) =>
      api.get(`/v1/usage?from=${encodeURIComponent(d.from)}&to=${encodeURIComponent(d.to)}`),
    );
  } catch (err) {
    if (err instanceof ApiError && err.status === 403) {
      $("usage-section").hidden = true;
      return;
    }
    throw err;
  }
  const series = days.map((d, i) => ({ day: d.day, totals: totals[i].totals }));
  replace($("usage-chart"), usageChart(series));
  const sum = series.reduce((a, d) => a + d.totals.cpu_core_hours, 0);
  const ram = series.reduce((a, d) => a + d.totals.ram_gb_hours, 0);
  $("usage-summary").textContent =
    `${USAGE_DAYS} days: ${sum.toFixed(4)} CPU core-hours, ${ram.toFixed(4)} RAM GB-hours.`;
}

// ---- templates -----------------------------------------------------------------------------

async function loadTemplates() {
  const list = await api.get("/v1/templates");
  const body = $("templates").querySelector("tbody");
  if (!Array.isArray(list.templates)) {
    // The sessions API form: `{ id: { ready } }`.
    sessionsApiNotice();
    const entries = Object.entries(list.templates);
    replace(
      body,
      ...entries.map(([id, t]) =>
        el(
          "tr",
          { dataset: { template: id } },
          el("td", { class: "id" }, id),
          el("td", {}, ""),
          el("td", {}, ""),
          el(
            "td",
            {},
            el(
              "span",
              { class: `state state-${t.ready ? "Live" : "Pending"}` },
              t.ready ? "ready" : "building",
            ),
          ),
          el("td", {}, ""),
        ),
      ),
    );
    return;
  }
  const details = await mapLimited(list.templates, PARALLEL, (t) =>
    api.get(`/v1/templates/${encodeURIComponent(t.id)}`).catch(() => undefined),
  );
  replace(body, ...list.templates.map((t, i) => templateRow(t, details[i])));
  const baking = details.some((d) => d && d.phase !== "Live" && d.phase !== "Failed");
  clearTimeout(bakePoll);
  if (baking)
    bakePoll = setTimeout(() => loadTemplates().catch((err) => status(errorText(err), true)), BAKE_POLL_MS);
}

function templateRow(t, d) {
  const phase = d?.phase ?? "?";
  return el(
    "tr",
    { dataset: { template: t.id } },
    el("td", { class: "id" }, t.id),
    el("td", {}, t.name),
    el("td", {}, t.visibility),
    el("td", {}, el("span", { class: `state state-${phase}` }, phase)),
    el("td", {}, d ? bakeProgress(d) : ""),
  );
}

/** The four phases, done / current / to come (or failed), and the telemetry measured so far. */
function bakeProgress(d) {
  const at = PHASES.indexOf(d.phase);
  const tel = d.telemetry ?? {};
  const took = { Pending: tel.pending_ms, Converting: tel.converting_ms, Distributing: tel.distributing_ms };
  const steps = PHASES.map((p, i) => {
    let cls = "todo";
    if (d.phase === "Failed") cls = took[p] !== undefined ? "done" : "failed";
    else if (i < at || d.phase === "Live") cls = "done";
    else if (i === at) cls = "current";
    const label = took[p] !== undefined ? `${p} ${ms(took[p])}` : p;
    return el("li", { class: cls }, label);
  });
  const parts = [
    ["pull", tel.pull_ms],
    ["import", tel.import_ms],
    ["boot", tel.boot_ms],
    ["ready cmd", tel.ready_cmd_ms],
    ["snapshot", tel.snapshot_ms],
    ["total", tel.total_ms],
  ]
    .filter(([, v]) => v !== undefined)
    .map(([name, v]) => `${name} ${ms(v)}`);
  const box = el("div", {}, el("ol", { class: "phases" }, ...steps));
  if (parts.length > 0) box.append(el("div", { class: "telemetry" }, parts.join(" · ")));
  if (d.error) box.append(el("div", { class: "telemetry" }, `error: ${d.error}`));
  return box;
}

// ---- wiring --------------------------------------------------------------------------------

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const input = $("key-input");
  const k = input.value.trim();
  input.value = "";
  if (k.length === 0) return;
  sessionStorage.setItem(KEY_STORAGE, k);
  start(k).catch((err) => status(errorText(err), true));
});
$("forget").addEventListener("click", () => {
  closeTerminal();
  closeMetrics();
  clearTimeout(bakePoll);
  sessionStorage.removeItem(KEY_STORAGE);
  key = undefined;
  api = undefined;
  showLogin();
  status("");
});
$("refresh").addEventListener("click", () => refresh());
$("terminal-close").addEventListener("click", () => closeTerminal());
$("metrics-close").addEventListener("click", () => closeMetrics());

const saved = sessionStorage.getItem(KEY_STORAGE);
if (saved) start(saved).catch((err) => status(errorText(err), true));
else showLogin();

/**
 * The web console: asks once for an API key (kept in this tab's sessionStorage, sent only as
 * `Authorization: Bearer` and, for terminals, as a WebSocket subprotocol), then shows the
 * tenant's sandboxes, their snapshots, templates with their bake progress, usage by day, a
 * sandbox's live metrics, and opens terminals. A sandbox can be snapshotted and rolled back to a
 * snapshot in place; a snapshot can be deleted or started as a new sandbox.
 * Every value from the API is rendered as text (dom.js), never as markup.
 *
 * A sandboxes API key (demo, pro, enterprise) sees everything; fork and snapshots need pro or better. A sessions API key
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
let restoreView;

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
  for (const id of ["sandboxes-section", "snapshots-section", "usage-section"]) $(id).hidden = false;
  // The key's tier is its second part (svc_<tier>_...), its secret the last: the rest is shown so
  // the user knows which key is in use (svc_<tier>[_<region>]_<id>).
  $("whoami").textContent = `${k.split("_")[1] ?? "?"} key ${k.split("_").slice(0, -1).join("_")}_…`;
  await refresh();
}

/** Reloads every view; whether all of it loaded (a failure is shown in the status line). */
async function refresh() {
  status("Loading…");
  const results = await Promise.allSettled([loadSandboxes(), loadSnapshots(), loadUsage(), loadTemplates()]);
  const failed = results.find((r) => r.status === "rejected");
  if (failed) {
    if (failed.reason instanceof ApiError && failed.reason.status === 401) {
      sessionStorage.removeItem(KEY_STORAGE);
      showLogin();
      status("The key was refused (401).", true);
      return false;
    }
    status(errorText(failed.reason), true);
    return false;
  }
  status(`Updated ${new Date().toLocaleTimeString()}`);
  return true;
}

function sessionsApiNotice() {
  const n = $("notice");
  n.hidden = false;
  n.textContent =
    "This is a sessions API key (live or scale): sandboxes, snapshots, usage, terminals into sandboxes, " +
    "fork and delete belong to sandboxes API keys (demo, pro, enterprise). Its templates are listed below.";
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
  const path = `/v1/sandboxes/${encodeURIComponent(s.id)}`;
  if (s.state === "running") {
    actions.append(
      button("Terminal", () => showTerminal(s.id)),
      button("Snapshot", () => act(`Snapshotting ${s.id}`, () => api.post(`${path}/snapshots`, {}))),
      button("Restore…", () => showRestore(s)),
    );
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
        if (restoreView?.sandboxId === s.id) closeRestore();
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

/**
 * Runs one action (`what` shown while it runs), then reloads the page's views; `fn` may return a
 * line to show once they are loaded (what the action measured), else the status says "Updated".
 */
async function act(what, fn) {
  status(`${what}…`);
  let done;
  try {
    done = await fn();
  } catch (err) {
    status(`${what} failed: ${errorText(err)}`, true);
    return;
  }
  if ((await refresh()) && typeof done === "string") status(done);
}

// ---- snapshots -----------------------------------------------------------------------------

/** The tenant's snapshots, newest first: the first page (50, as the sandboxes' list shows). */
async function loadSnapshots() {
  let list;
  try {
    list = await api.get("/v1/snapshots");
  } catch (err) {
    if (err instanceof ApiError && err.status === 403) {
      $("snapshots-section").hidden = true;
      return;
    }
    throw err;
  }
  const rows = list.snapshots;
  replace($("snapshots").querySelector("tbody"), ...rows.map(snapshotRow));
  $("snapshots-empty").hidden = rows.length > 0;
}

function snapshotRow(snap) {
  const path = `/v1/snapshots/${encodeURIComponent(snap.id)}`;
  const actions = el("td", { class: "actions" });
  if (snap.state === "ready") {
    actions.append(
      button("New sandbox", () =>
        act(`Creating a sandbox from ${snap.id}`, async () => {
          const r = await api.post("/v1/sandboxes", { snapshot: snap.id });
          return `Created ${r.id} from ${snap.id}`;
        }),
      ),
    );
  }
  actions.append(
    button(
      "Delete",
      () => {
        if (!confirm(`Delete snapshot ${snap.id}?`)) return;
        return act(`Deleting ${snap.id}`, () => api.del(path));
      },
      "danger",
    ),
  );
  const created = Date.parse(snap.created_at);
  return el(
    "tr",
    { dataset: { snapshot: snap.id } },
    el("td", { class: "id" }, snap.id),
    el("td", {}, snap.name ?? ""),
    el(
      "td",
      snap.error ? { title: snap.error } : {},
      el("span", { class: `state state-${snap.state}` }, snap.state),
    ),
    el("td", {}, mib(snap.size_bytes)),
    el("td", { class: "id" }, snap.source_sandbox),
    el("td", {}, snap.template),
    el(
      "td",
      { title: snap.created_at },
      Number.isNaN(created) ? "" : `${age((Date.now() - created) / 1000)} ago`,
    ),
    actions,
  );
}

/**
 * The restore panel of one sandbox: its template's ready snapshots, the sandbox's own first
 * (newest first; the server refuses, 409, one kept on another host or of another size).
 */
async function showRestore(s) {
  closeRestore();
  const view = { sandboxId: s.id };
  restoreView = view;
  $("restore-section").hidden = false;
  $("restore-title").textContent = s.id;
  const select = $("restore-snapshot");
  select.replaceChildren();
  $("restore-go").disabled = true;
  $("restore-none").hidden = true;
  const q = (params) => api.get(`/v1/snapshots?${new URLSearchParams({ state: "ready", ...params })}`);
  let own;
  let same;
  try {
    [own, same] = await Promise.all([q({ source_sandbox: s.id }), q({ template: s.template })]);
  } catch (err) {
    if (restoreView === view) status(`Listing snapshots failed: ${errorText(err)}`, true);
    return;
  }
  if (restoreView !== view) return;
  const seen = new Set();
  const choices = [...own.snapshots, ...same.snapshots].filter((x) => !seen.has(x.id) && seen.add(x.id));
  replace(
    select,
    ...choices.map((x) =>
      el(
        "option",
        { value: x.id },
        `${x.id}${x.name ? ` (${x.name})` : ""}${x.source_sandbox === s.id ? "" : ` of ${x.source_sandbox}`}, ${x.created_at}`,
      ),
    ),
  );
  $("restore-go").disabled = choices.length === 0;
  $("restore-none").hidden = choices.length > 0;
  $("restore-none").textContent = `No ready snapshots of template ${s.template}: take one with Snapshot.`;
}

function closeRestore() {
  restoreView = undefined;
  $("restore-section").hidden = true;
  $("restore-snapshot").replaceChildren();
}

function restoreChosen() {
  const id = restoreView?.sandboxId;
  const snap = $("restore-snapshot").value;
  if (!id || !snap) return;
  closeRestore();
  if (terminal?.sandboxId === id) closeTerminal();
  return act(`Restoring ${id} to ${snap}`, async () => {
    const r = await api.post(`/v1/sandboxes/${encodeURIComponent(id)}/restore`, { snapshot: snap });
    return `Restored ${r.id} to ${r.snapshot} in ${ms(r.restore_ms)} (down ${ms(r.down_ms)})`;
  });
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
  closeRestore();
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
$("restore-close").addEventListener("click", () => closeRestore());
$("restore-go").addEventListener("click", () => restoreChosen());

const saved = sessionStorage.getItem(KEY_STORAGE);
if (saved) start(saved).catch((err) => status(errorText(err), true));
else showLogin();

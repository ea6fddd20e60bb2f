/**
 * E2B's control plane (docs/e2b.md "Control plane"): its REST paths, as e2b 2.45.0 calls them,
 * over the sandboxes API's core. Every path needs a sandboxes API key (auth.ts) and answers errors
 * in E2B's form; ids are E2B's (`sbx_abc` is `abc`, contracts/e2b/ids.ts), and an id that cannot
 * be one of ours is 404 as an unknown one is. What E2B has and sandboxd does not serve answers 501
 * (the last route), and a field it cannot honour 400, each saying so.
 */
import { type Context, Hono } from "hono";
import { SnapshotId } from "../../contracts/api/common.ts";
import { MAX_LABEL_FILTERS, MAX_LIST_LIMIT } from "../../contracts/api/limits.ts";
import { bestEffort } from "../../contracts/best-effort.ts";
import * as E from "../../contracts/e2b/control.ts";
import { E2B_ENVD_VERSION, e2bSandboxId, sandboxIdOfE2b } from "../../contracts/e2b/ids.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Principal } from "../auth/keys.ts";
import { setSandboxEgress } from "../core/egress.ts";
import { wakeIfIdle } from "../core/idle.ts";
import { setSandboxTimeout } from "../core/lifetimes.ts";
import { sandboxMetrics } from "../core/metrics.ts";
import { ownRegion } from "../core/regions.ts";
import {
  createVm,
  destroyVm,
  forkVm,
  getOwned,
  type ListFilter,
  listOwnedPage,
  resumeVm,
  type SandboxRow,
  suspendVm,
} from "../core/sandboxes.ts";
import {
  createFromSnapshot,
  deleteSnapshot,
  listSnapshotsPage,
  type SnapshotFilter,
  type SnapshotRow,
  takeSnapshot,
} from "../core/snapshots.ts";
import { type Deps, type HonoEnv, logOf } from "../deps.ts";
import { jsonBody, query, queryWithRepeats } from "../http.ts";
import { idleLifetime } from "../routes/sandboxes.ts";
import { e2bErrorResponse, e2bKey, notServed, unsupportedField } from "./auth.ts";
import { signEnvdToken } from "./envd-token.ts";
import type { E2bMountDeps } from "./mount.ts";

/** `clientID`, deprecated by E2B and read by no SDK: one fixed value. */
const CLIENT_ID = "sandboxd";
/** `endAt` of a sandbox with no absolute lifetime (one made through /v1 without `timeout_seconds`). */
const NO_DEADLINE = "9999-12-31T23:59:59.999Z";
/** E2B's "all traffic" in `allowOut`/`denyOut`. */
const ALL_TRAFFIC = "0.0.0.0/0";
const MIB = 1024 * 1024;

/** Our id of an E2B id in a path: one that cannot name a sandbox of ours is 404, as an unknown one. */
function idOf(c: Context): string {
  const e2bId = c.req.param("id") ?? "";
  const id = sandboxIdOfE2b(e2bId);
  if (id === undefined) throw new SandboxdError("not_found", `sandbox ${e2bId.slice(0, 64)} not found`);
  return id;
}

/** E2B's `Sandbox`: what create, connect, resume and fork answer, with a fresh data-plane token. */
async function sandboxOf(deps: Deps, p: Principal, row: Pick<SandboxRow, "id" | "templateId">) {
  return {
    sandboxID: e2bSandboxId(row.id),
    templateID: row.templateId,
    clientID: CLIENT_ID,
    envdVersion: E2B_ENVD_VERSION,
    envdAccessToken: await signEnvdToken(
      deps.config.connectSecret,
      p,
      row.id,
      Math.floor(deps.clock() / 1000),
      // Read by an edge to route the data plane's calls to the tenant's region (docs/edge.md).
      await ownRegion(deps, p.tenantId),
    ),
    domain: deps.config.e2bDomain ?? null,
    trafficAccessToken: null,
  };
}

/** E2B's `ListedSandbox` of a row. */
function listedOf(row: SandboxRow) {
  return {
    sandboxID: e2bSandboxId(row.id),
    templateID: row.templateId,
    clientID: CLIENT_ID,
    metadata: row.labels,
    startedAt: row.createdAt.toISOString(),
    endAt: row.expiresAt?.toISOString() ?? NO_DEADLINE,
    state: row.state === "suspended" ? ("paused" as const) : ("running" as const),
    cpuCount: row.vcpus,
    memoryMB: row.memMib,
    // The guest disk's size is not recorded (the row keeps the overlay's bytes, for metering).
    diskSizeMB: 0,
    envdVersion: E2B_ENVD_VERSION,
  };
}

/**
 * The egress allow-list (docs/egress.md) for E2B's network settings. E2B allows all traffic
 * unless told otherwise (`*` here: the operator's internal addresses stay closed whatever it
 * says); `allow_internet_access: false` or `denyOut: ["0.0.0.0/0"]` deny all but `allowOut`.
 * sandboxd's egress is an allow-list of host names: denying single addresses, per-host
 * transforms and a SOCKS5 proxy have no equivalent and are refused.
 */
function egressOf(
  allowInternet: boolean | undefined,
  net: Pick<E.E2bNetwork, "allowOut" | "denyOut" | "rules" | "egressProxy"> | undefined,
): string[] {
  if (net?.rules !== undefined && Object.keys(net.rules).length > 0) {
    throw unsupportedField("network.rules", "sandboxd's egress has no per-host request transforms");
  }
  if (net?.egressProxy !== undefined && net.egressProxy !== null) {
    throw unsupportedField("network.egressProxy", "sandboxd's egress does not tunnel through a proxy");
  }
  const deny = net?.denyOut ?? [];
  if (deny.some((d) => d !== ALL_TRAFFIC)) {
    throw unsupportedField(
      "network.denyOut",
      `sandboxd's egress is an allow-list: it can deny all traffic (${ALL_TRAFFIC}) except allowOut, not single addresses`,
    );
  }
  if (allowInternet !== false && deny.length === 0) return ["*"];
  return (net?.allowOut ?? []).map((a) => (a === ALL_TRAFFIC ? "*" : a));
}

/** Fields of `POST /sandboxes` sandboxd has no equivalent for: 400 before anything is made. */
function refuseUnsupported(req: E.NewSandbox): void {
  if (req.mcp !== undefined && req.mcp !== null) throw unsupportedField("mcp", "there is no MCP gateway");
  if (req.iam !== undefined && req.iam !== null)
    throw unsupportedField("iam", "there is no workload identity");
  if (req.volumeMounts !== undefined && req.volumeMounts.length > 0) {
    throw unsupportedField("volumeMounts", "there are no volumes");
  }
  if (req.autoPauseMemory === false) {
    throw unsupportedField("autoPauseMemory", "a pause always keeps the sandbox's memory");
  }
  if (req.network?.maskRequestHost !== undefined) {
    throw unsupportedField("network.maskRequestHost", "sandbox hosts are not rewritten");
  }
  if (req.network?.allowPublicTraffic === false) {
    throw unsupportedField("network.allowPublicTraffic", "there are no traffic access tokens");
  }
}

/**
 * E2B's metadata filter, `k=v&...` with each key and value URL-encoded (the SDK encodes them, then
 * the pairs): label pairs every row must hold, as `label=k:v` of /v1 (at most 16, one value per key).
 */
function metadataFilter(raw: string | undefined): Record<string, string> | undefined {
  if (raw === undefined || raw === "") return undefined;
  const out: Record<string, string> = {};
  for (const [k, v] of new URLSearchParams(raw)) {
    let key: string;
    let value: string;
    try {
      key = decodeURIComponent(k);
      value = decodeURIComponent(v);
    } catch {
      throw new SandboxdError("bad_request", "invalid query: metadata is not URL-encoded key=value pairs");
    }
    if (Object.hasOwn(out, key) && out[key] !== value) {
      throw new SandboxdError(
        "bad_request",
        `invalid query: metadata ${JSON.stringify(key)} is asked with two values`,
      );
    }
    out[key] = value;
  }
  if (Object.keys(out).length > MAX_LABEL_FILTERS) {
    throw new SandboxdError("bad_request", `invalid query: at most ${MAX_LABEL_FILTERS} metadata filters`);
  }
  return out;
}

/** E2B's `state` filter (comma-separated or repeated) as our one-state filter; both or none: all. */
function stateFilter(given: string[] | undefined): ListFilter["state"] {
  const states = new Set((given ?? []).flatMap((s) => s.split(",")).filter((s) => s !== ""));
  for (const s of states) {
    if (!E.E2bSandboxState.safeParse(s).success) {
      throw new SandboxdError(
        "bad_request",
        `invalid query: state ${JSON.stringify(s)} is not running or paused`,
      );
    }
  }
  if (states.size !== 1) return undefined;
  return states.has("paused") ? "suspended" : "running";
}

/** E2B's `SandboxMetric` of one of our samples. */
function metricOf(
  s: { at: string; cpu_percent: number | null; memory_used_bytes: number; disk_used_bytes: number },
  vcpus: number,
  memTotal: number,
  diskTotal: number,
) {
  const at = new Date(s.at);
  return {
    timestamp: s.at,
    timestampUnix: Math.floor(at.getTime() / 1000),
    cpuCount: vcpus,
    // Ours is % of one host core (up to 100 per vCPU); E2B's is % of the sandbox's CPUs.
    cpuUsedPct: s.cpu_percent === null || vcpus === 0 ? 0 : Math.round((s.cpu_percent / vcpus) * 100) / 100,
    memUsed: s.memory_used_bytes,
    memTotal,
    memCache: 0,
    diskUsed: s.disk_used_bytes,
    diskTotal,
  };
}

async function metricsOf(deps: Deps, p: Principal, id: string) {
  const m = await sandboxMetrics(deps, p, id);
  const row = await getOwned(deps, p, id, { cached: true });
  const vcpus = m.vcpus ?? row.vcpus;
  const memTotal = m.memory_limit_bytes ?? row.memMib * MIB;
  // The guest disk's size is not known to the gateway: 0, as diskSizeMB.
  return m.samples.map((s) => metricOf(s, vcpus, memTotal, 0));
}

function snapshotOf(row: SnapshotRow) {
  return { snapshotID: row.id, names: row.name !== null ? [row.name] : [] };
}

export function e2bControlRoutes(deps: Deps, m: E2bMountDeps): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  const log = logOf(deps);
  const key = e2bKey(m);
  const max = () => deps.config.limits.maxJsonBodyBytes;
  app.onError((err, c) => e2bErrorResponse(err, c, log));

  app.post("/sandboxes", key, async (c) => {
    const p = c.get("principal");
    const req = await jsonBody(c, E.NewSandbox, max());
    refuseUnsupported(req);
    const egressAllow = egressOf(req.allow_internet_access, req.network);
    // E2B's timeout deletes the sandbox, or pauses it with `autoPause` (our suspend, which the
    // next call or connect resumes).
    const lifetime = {
      timeoutS: req.timeout ?? E.E2B_DEFAULT_TIMEOUT_S,
      onTimeout: req.autoPause === true ? ("suspend" as const) : ("delete" as const),
    };
    const input = { labels: req.metadata ?? {}, egressAllow, lifetime, idle: idleLifetime(deps, {}) };
    const name = req.templateID ?? E.E2B_DEFAULT_TEMPLATE;
    // E2B starts a sandbox from a snapshot by naming it as the template.
    const { row } = SnapshotId.safeParse(name).success
      ? await createFromSnapshot(deps, p, { snapshotId: name, ...input })
      : await createVm(deps, p, "sandbox", { templateId: name, ...input });
    try {
      await m.envs.write(deps, row, req.envVars ?? {});
    } catch (err) {
      // A sandbox without the environment it was asked for is not the one asked for: none is made.
      await bestEffort(log, `removing ${row.id}, whose environment could not be written`, () =>
        destroyVm(deps, row, { force: true, reason: "deleted" }),
      );
      throw err;
    }
    return c.json(await sandboxOf(deps, p, row), 201);
  });

  app.get("/v2/sandboxes", key, async (c) => {
    const q = queryWithRepeats(c, E.ListSandboxesQuery, ["state"]);
    if (q.startedAfter !== undefined)
      throw unsupportedField("startedAfter", "lists are not filtered by time");
    if (q.order === "desc") {
      throw unsupportedField("order=desc", "sandboxd lists oldest first (order=asc)");
    }
    const filter: ListFilter = {};
    const labels = metadataFilter(q.metadata);
    if (labels !== undefined) filter.labels = labels;
    const state = stateFilter(q.state);
    if (state !== undefined) filter.state = state;
    if (q.template !== undefined) filter.templateId = q.template;
    const page = await listOwnedPage(deps, c.get("principal"), filter, {
      limit: q.limit ?? E.E2B_DEFAULT_PAGE,
      cursor: q.nextToken,
    });
    if (page.next !== null) c.header("x-next-token", page.next);
    return c.json(page.rows.map(listedOf));
  });

  // E2B's deprecated list: every running sandbox, unpaged. Walked page by page; the running
  // quota of the key's tier bounds how many there are.
  app.get("/sandboxes", key, async (c) => {
    const q = query(c, E.LegacyListQuery);
    const filter: ListFilter = { state: "running" };
    const labels = metadataFilter(q.metadata);
    if (labels !== undefined) filter.labels = labels;
    const rows: SandboxRow[] = [];
    let cursor: string | undefined;
    do {
      const page = await listOwnedPage(deps, c.get("principal"), filter, { limit: MAX_LIST_LIMIT, cursor });
      rows.push(...page.rows);
      cursor = page.next ?? undefined;
    } while (cursor !== undefined);
    return c.json(rows.map(listedOf));
  });

  // Before `/sandboxes/:id`: "metrics" is a well-formed E2B id.
  app.get("/sandboxes/metrics", key, async (c) => {
    const p = c.get("principal");
    const q = queryWithRepeats(c, E.ManyMetricsQuery, ["sandbox_ids"]);
    const ids = [...new Set(q.sandbox_ids.flatMap((s) => s.split(",")).filter((s) => s !== ""))];
    if (ids.length > E.MAX_METRICS_IDS) {
      throw new SandboxdError("bad_request", `invalid query: at most ${E.MAX_METRICS_IDS} sandbox_ids`);
    }
    const out: Record<string, ReturnType<typeof metricOf>> = {};
    for (const e2bId of ids) {
      const id = sandboxIdOfE2b(e2bId);
      if (id === undefined) continue;
      try {
        const last = (await metricsOf(deps, p, id)).at(-1);
        if (last !== undefined) out[e2bSandboxId(id)] = last;
      } catch (err) {
        // Unknown and other tenants' ids are left out, as E2B leaves out ones it has no metrics of.
        if (err instanceof SandboxdError && err.code === "not_found") continue;
        throw err;
      }
    }
    return c.json({ sandboxes: out });
  });

  app.get("/sandboxes/:id", key, async (c) => {
    const p = c.get("principal");
    const row = await getOwned(deps, p, idOf(c), { cached: true });
    const s = await sandboxOf(deps, p, row);
    return c.json({
      ...listedOf(row),
      envdAccessToken: s.envdAccessToken,
      domain: s.domain,
      lifecycle: {
        onTimeout: row.onTimeout === "suspend" ? ("pause" as const) : ("kill" as const),
        // A sandbox suspended at its timeout resumes on its next call or connect.
        autoResume: row.onTimeout === "suspend",
      },
    });
  });

  app.delete("/sandboxes/:id", key, async (c) => {
    const row = await getOwned(deps, c.get("principal"), idOf(c));
    await destroyVm(deps, row, { force: true, reason: "deleted" });
    return c.body(null, 204);
  });

  app.post("/sandboxes/:id/timeout", key, async (c) => {
    const id = idOf(c);
    const req = await jsonBody(c, E.SandboxTimeoutRequest, max());
    await setSandboxTimeout(deps, c.get("principal"), id, req.timeout, undefined);
    return c.body(null, 204);
  });

  // Resumes a paused sandbox (201) with a lifetime of `timeout` from now; a running one (200)
  // keeps its deadline unless `timeout` from now is later (E2B only extends it there).
  app.post("/sandboxes/:id/connect", key, async (c) => {
    const p = c.get("principal");
    const id = idOf(c);
    const req = await jsonBody(c, E.ConnectSandbox, max());
    const row = await getOwned(deps, p, id);
    if (row.state === "suspended") {
      await resumeVm(deps, p, id);
      const now = await setSandboxTimeout(deps, p, id, req.timeout, undefined);
      return c.json(await sandboxOf(deps, p, now), 201);
    }
    const wanted = deps.clock() + req.timeout * 1000;
    if (row.expiresAt !== null && row.expiresAt.getTime() < wanted) {
      await setSandboxTimeout(deps, p, id, req.timeout, undefined);
    }
    return c.json(await sandboxOf(deps, p, row), 200);
  });

  // E2B's pause is our suspend; an already paused sandbox is 409, which the SDK reads as `false`.
  app.post("/sandboxes/:id/pause", key, async (c) => {
    const id = idOf(c);
    const req = await jsonBody(c, E.SandboxPauseRequest, max());
    if (req.memory === false) throw unsupportedField("memory: false", "a pause always keeps the memory");
    await suspendVm(deps, c.get("principal"), id);
    return c.body(null, 204);
  });

  // Deprecated by E2B for connect: a running sandbox is 409.
  app.post("/sandboxes/:id/resume", key, async (c) => {
    const p = c.get("principal");
    const id = idOf(c);
    const req = await jsonBody(c, E.ResumedSandbox, max());
    const row = await getOwned(deps, p, id);
    if (row.state !== "suspended") {
      throw new SandboxdError("conflict", `sandbox ${id} is ${row.state}, not paused`);
    }
    await resumeVm(deps, p, id);
    const now = await setSandboxTimeout(deps, p, id, req.timeout ?? E.E2B_DEFAULT_TIMEOUT_S, undefined);
    return c.json(await sandboxOf(deps, p, now), 201);
  });

  // Our fork (all children or none): each child gets `timeout` from now.
  app.post("/sandboxes/:id/fork", key, async (c) => {
    const p = c.get("principal");
    const id = idOf(c);
    const req = await jsonBody(c, E.SandboxForkRequest, max());
    await wakeIfIdle(deps, p, id);
    const { children } = await forkVm(deps, p, id, req.count ?? 1, []);
    const out = [];
    for (const ch of children) {
      const row = await setSandboxTimeout(deps, p, ch.id, req.timeout ?? E.E2B_DEFAULT_TIMEOUT_S, undefined);
      out.push({ sandbox: await sandboxOf(deps, p, row) });
    }
    return c.json(out, 201);
  });

  app.post("/sandboxes/:id/snapshots", key, async (c) => {
    const p = c.get("principal");
    const id = idOf(c);
    const req = await jsonBody(c, E.SandboxSnapshotRequest, max());
    await wakeIfIdle(deps, p, id);
    const row = await takeSnapshot(deps, p, id, {
      labels: {},
      ...(req.name !== undefined ? { name: req.name } : {}),
    });
    return c.json(snapshotOf(row), 201);
  });

  app.get("/sandboxes/:id/metrics", key, async (c) => {
    const id = idOf(c);
    const q = query(c, E.MetricsQuery);
    const all = await metricsOf(deps, c.get("principal"), id);
    return c.json(
      all.filter(
        (s) =>
          (q.start === undefined || s.timestampUnix >= q.start) &&
          (q.end === undefined || s.timestampUnix <= q.end),
      ),
    );
  });

  // E2B replaces the whole egress config; ours is the allow-list that config comes to.
  app.put("/sandboxes/:id/network", key, async (c) => {
    const id = idOf(c);
    const req = await jsonBody(c, E.E2bNetworkUpdate, max());
    await setSandboxEgress(deps, c.get("principal"), id, egressOf(req.allow_internet_access, req));
    return c.body(null, 204);
  });

  app.get("/snapshots", key, async (c) => {
    const q = query(c, E.ListSnapshotsQuery);
    const filter: SnapshotFilter = {};
    if (q.name !== undefined) filter.name = q.name;
    if (q.sandboxID !== undefined) {
      const source = sandboxIdOfE2b(q.sandboxID);
      if (source === undefined) return c.json([]);
      filter.sourceSandboxId = source;
    }
    const page = await listSnapshotsPage(deps, c.get("principal"), filter, {
      limit: q.limit ?? E.E2B_DEFAULT_PAGE,
      cursor: q.nextToken,
    });
    if (page.next !== null) c.header("x-next-token", page.next);
    return c.json(page.rows.map(snapshotOf));
  });

  // E2B deletes a snapshot as the template it is; a template of ours is not deleted here.
  app.delete("/templates/:id", key, async (c) => {
    const id = c.req.param("id");
    if (!SnapshotId.safeParse(id).success) {
      throw notServed("deleting a template", "DELETE /v1/templates/{id} does");
    }
    await deleteSnapshot(deps, c.get("principal"), id);
    return c.body(null, 204);
  });

  // Everything else of E2B's API (templates and builds, volumes, secrets, teams, logs, refreshes):
  // 501 in E2B's form once the key is known good. Data-plane paths are the envd mount's.
  app.all("*", async (c, next) => {
    if (c.req.path === "/e2b/envd" || c.req.path.startsWith("/e2b/envd/")) return next();
    await key(c, async () => {});
    throw notServed(`${c.req.method} ${c.req.path.replace(/^\/e2b/, "")}`);
  });
  return app;
}

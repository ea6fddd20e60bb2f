/**
 * The density benchmark's service (density.ts): a real `up` on a fresh data dir with one tenant's
 * keys and the template uploaded, and the session calls the benchmark makes through it.
 */
import { type Leftovers, leftovers } from "./footprint.ts";
import {
  createKey,
  seededDataDir,
  spawnUp,
  stopAndRemove,
  stopUp,
  uploadTemplateAndWait,
} from "./service.ts";

const TEMPLATE_ID = "bench";
/** Destroys finish in the background of the API's answer (the VM's directory, its cgroup). */
const DESTROY_SETTLE_MS = 1_000;

export interface Service {
  base: string;
  pid: number;
  dataDir: string;
  key: string;
  logTail(): string;
}

export interface ServiceLeftovers {
  leftovers: Leftovers;
}

interface Answer {
  status: number;
  body: Record<string, unknown>;
}

/** One request that never throws on an HTTP error: the status and the parsed body. */
async function request(svc: Service, method: string, path: string, body?: unknown): Promise<Answer> {
  const res = await fetch(new URL(path, svc.base), {
    method,
    headers: {
      authorization: `Bearer ${svc.key}`,
      ...(body === undefined ? {} : { "content-type": "application/json" }),
    },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  let parsed: Record<string, unknown> = {};
  try {
    parsed = text === "" ? {} : (JSON.parse(text) as Record<string, unknown>);
  } catch {
    parsed = { message: text.slice(0, 300) };
  }
  return { status: res.status, body: parsed };
}

/** The error code of a failed answer (`{code, message}` envelope), or the status. */
function codeOf(a: Answer): string {
  return typeof a.body.code === "string" ? a.body.code : `http_${a.status}`;
}

/**
 * Starts `up` on a fresh data dir with a live and a scale key of one tenant, uploads `image` as
 * the template, runs `body`, then deletes nothing itself: `body` frees what it made. Stops the
 * service, counts its leftovers, and removes the data dir and its RAM files.
 */
export async function withService<T>(
  o: { image: string; cacheDir: string; log: (m: string) => void },
  body: (svc: Service) => Promise<T>,
): Promise<T & ServiceLeftovers> {
  const dataDir = await seededDataDir("sbx-density-", o.cacheDir, o.log);
  const live = createKey(dataDir, "bench", "live");
  const scale = createKey(dataDir, "bench", "scale");
  const { up, listening, stderrTail: logTail } = spawnUp(dataDir, {});
  try {
    const base = await listening;
    o.log(`bench: up ${base} (pid ${up.pid}), data ${dataDir}`);
    await uploadTemplateAndWait(base, scale, TEMPLATE_ID, o.image);
    const result = await body({ base, pid: up.pid!, dataDir, key: live, logTail });
    await Bun.sleep(DESTROY_SETTLE_MS);
    // Counted once the service has stopped: its pre-launched QEMUs are its own until then.
    await stopUp(up);
    return { ...result, leftovers: await leftovers(dataDir) };
  } finally {
    await stopAndRemove(up, dataDir);
  }
}

export interface Created {
  ms: number;
  id?: string;
  code?: string;
  answer?: Answer;
}

export async function createSession(svc: Service): Promise<Created> {
  const t0 = performance.now();
  try {
    const a = await request(svc, "POST", "/v1/sessions", { template_id: TEMPLATE_ID });
    const ms = performance.now() - t0;
    if (a.status < 300 && typeof a.body.session_id === "string") return { ms, id: a.body.session_id };
    return { ms, code: codeOf(a), answer: a };
  } catch (err) {
    return {
      ms: performance.now() - t0,
      code: `network: ${err instanceof Error ? err.message : String(err)}`,
    };
  }
}

/** Deletes the sessions; returns how many deletes failed. */
export async function deleteSessions(svc: Service, ids: readonly string[]): Promise<number> {
  const answers = await Promise.all(
    ids.map((id) => request(svc, "DELETE", `/v1/sessions/${id}`).catch(() => ({ status: 0, body: {} }))),
  );
  return answers.filter((a) => a.status >= 300 || a.status === 0).length;
}

/**
 * `new Sandboxd({ baseUrl, apiKey })`: the entry to every call. Without options it reads
 * `SANDBOXD_URL` and `SANDBOXD_API_KEY` from the environment.
 */
import { SandboxdError } from "./errors.ts";
import { type Body, DEFAULT_RETRY, type Fetch, type RetryOptions, Transport } from "./http.ts";
import { allRows, followPages, labelQuery } from "./paging.ts";
import { Sandbox, Session } from "./sandbox.ts";
import {
  type CatalogEntry,
  type CreateSandboxResponse,
  type EgressPolicy,
  type ExecResult,
  execResult,
  type Health,
  type IdleAction,
  type Page,
  type ReadySpec,
  type RegistryAuth,
  type SandboxListOptions,
  type SandboxSummary,
  type SessionListOptions,
  type SessionSummary,
  type SnapshotInfo,
  type Template,
  type TemplateA,
  type TemplateB,
  type TemplateSummary,
  type TimeoutAction,
  type UsageResponse,
} from "./types.ts";

/**
 * The deadline of one ordinary call, ms: a create or fork restores VMs, which on a busy host
 * without hardware virtualisation takes tens of seconds; an exec's own limit extends it.
 */
const DEFAULT_TIMEOUT_MS = 300_000;
/** How often `templates.wait` asks for a template's phase, ms: a bake takes seconds to minutes. */
const TEMPLATE_POLL_MS = 1000;

export interface SandboxdOptions {
  /** The service, e.g. `http://127.0.0.1:8080`. Default: `SANDBOXD_URL`. */
  baseUrl?: string;
  /** An API key (`svc_<tier>_...`). Default: `SANDBOXD_API_KEY`. */
  apiKey?: string;
  /** Deadline of one call, ms (0 = none). Default 300 000. */
  timeoutMs?: number;
  /** Retries of 429/503 (`false`: none). Default: 3 retries, idempotent calls only. */
  retry?: RetryOptions | false;
  /** A `fetch` to use instead of the global one (a proxy agent, a test recorder). */
  fetch?: Fetch;
}

export interface CreateSandboxOptions {
  /** The template (catalog id, or a template of your own); this or `snapshot`. */
  template?: string;
  /** A snapshot of the tenant's (`snap_...`) to start from: its processes, memory and files as they were. */
  snapshot?: string;
  labels?: Record<string, string>;
  /** A single convenience label (stored as `labels.label`). */
  label?: string;
  /** Host names the sandbox may reach; without it, the operator's default policy. */
  egress?: EgressPolicy;
  idleTimeoutSeconds?: number;
  idleAction?: IdleAction;
  /** Absolute lifetime from create (and again from each resume); `setTimeout` changes it. */
  timeoutSeconds?: number;
  /** At the end of `timeoutSeconds`: `delete` (default) or `suspend`. */
  onTimeout?: TimeoutAction;
  /**
   * One of the template's size classes (its `sizes`); either field is enough when it names one.
   * Without both: the template's default size. Another size (or, with `snapshot`, any but the
   * snapshot's own) throws `size_unavailable`, whose `details.sizes` lists the sizes there are.
   */
  vcpus?: number;
  memoryMib?: number;
}

export interface BakeOptions {
  /** The template's name, also its id. */
  name: string;
  /** An OCI image reference (`[host[:port]/]path[:tag][@sha256:...]`). */
  image: string;
  /** Credentials for the image's registry; used for this bake only, never stored. */
  registryAuth?: RegistryAuth;
  ready?: ReadySpec;
  width?: number;
  expectedWidth?: number;
  /** Size classes a create may pick (`vcpus`, `memory_mib`), each frozen at the bake; the first is the default. */
  sizes?: { vcpus: number; memory_mib: number }[];
}

export interface UploadOptions {
  /** The template id. */
  id: string;
  /** The image archive (`docker save` / OCI tar) as bytes or a stream. */
  image: Body;
  memMib?: number;
  vcpuCount?: number;
  /** How long the build waits for the template's VM to come up, s. */
  waitSecs?: number;
}

export interface WaitOptions {
  /** Give up after this long, ms (default: the client's deadline). */
  timeoutMs?: number;
  /** Called with the template each time it is read (progress: phase, telemetry). */
  onProgress?: (t: Template) => void;
}

function env(name: string): string | undefined {
  const g = globalThis as {
    process?: { env?: Record<string, string | undefined> };
    Deno?: { env: { get(n: string): string | undefined } };
  };
  return g.process?.env?.[name] ?? g.Deno?.env.get(name);
}

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

export class Sandboxd {
  readonly sandboxes: Sandboxes;
  readonly sessions: Sessions;
  readonly snapshots: Snapshots;
  readonly templates: Templates;
  private readonly t: Transport;

  constructor(opts: SandboxdOptions = {}) {
    const baseUrl = opts.baseUrl ?? env("SANDBOXD_URL");
    if (!baseUrl) {
      throw new SandboxdError({
        code: "bad_request",
        status: 0,
        message: "no service URL: pass baseUrl or set SANDBOXD_URL",
      });
    }
    this.t = new Transport({
      baseUrl,
      apiKey: opts.apiKey ?? env("SANDBOXD_API_KEY"),
      timeoutMs: opts.timeoutMs ?? DEFAULT_TIMEOUT_MS,
      retry: opts.retry === false ? false : { ...DEFAULT_RETRY, ...opts.retry },
      fetch: opts.fetch ?? ((input, init) => fetch(input, init)),
      sleep,
      random: Math.random,
    });
    this.sandboxes = new Sandboxes(this.t);
    this.sessions = new Sessions(this.t);
    this.snapshots = new Snapshots(this.t);
    this.templates = new Templates(this.t);
  }

  /** The service's base URL. */
  get baseUrl(): string {
    return this.t.o.baseUrl;
  }

  /** A one-shot of the sessions API: runs `code` in a fresh VM of `templateId`, which is thrown away after. */
  async exec(o: { code: string; templateId: string; timeoutSeconds?: number }): Promise<ExecResult> {
    const w = await this.t.json<Parameters<typeof execResult>[0]>("POST", "/v1/exec", {
      json: { code: o.code, template_id: o.templateId, timeout_seconds: o.timeoutSeconds },
      timeoutMs: Math.max(this.t.o.timeoutMs, (o.timeoutSeconds ?? 0) * 1000 + 60_000),
    });
    return execResult(w);
  }

  /**
   * The sessions API batch: one fresh VM per item, run in parallel. Each result is an `ExecResult`, or a
   * `SandboxdError` for an item that failed (the others are kept).
   */
  async execBatch(
    items: { code: string; templateId: string; timeoutSeconds?: number }[],
  ): Promise<(ExecResult | SandboxdError)[]> {
    const r = await this.t.json<{ results: Record<string, unknown>[] }>("POST", "/v1/exec/batch", {
      json: {
        executions: items.map((o) => ({
          code: o.code,
          template_id: o.templateId,
          timeout_seconds: o.timeoutSeconds,
        })),
      },
    });
    return r.results.map((x) => {
      if ("error" in x) {
        const e = x.error as { code: string; message: string };
        return new SandboxdError({
          code: e.code,
          status: Number(x.status),
          message: e.message,
          retryAfterSeconds: x.retry_after_seconds as number | undefined,
        });
      }
      return execResult(x as Parameters<typeof execResult>[0]);
    });
  }

  /** The sandboxes API: the tenant's metered usage over a window (default: this month so far). */
  usage(o: { from?: Date | string; to?: Date | string } = {}): Promise<UsageResponse> {
    const iso = (d: Date | string | undefined) => (d instanceof Date ? d.toISOString() : d);
    return this.t.json("GET", "/v1/usage", { query: { from: iso(o.from), to: iso(o.to) } });
  }

  /** The service's health (no key needed). */
  health(): Promise<Health> {
    return this.t.json("GET", "/v1/health");
  }
}

export class Sandboxes {
  constructor(private readonly t: Transport) {}

  async create(o: CreateSandboxOptions): Promise<Sandbox> {
    const r = await this.t.json<CreateSandboxResponse>("POST", "/v1/sandboxes", {
      json: {
        template: o.template,
        snapshot: o.snapshot,
        label: o.label,
        labels: o.labels,
        egress: o.egress,
        idle_timeout_seconds: o.idleTimeoutSeconds,
        idle_action: o.idleAction,
        timeout_seconds: o.timeoutSeconds,
        on_timeout: o.onTimeout,
        vcpus: o.vcpus,
        memory_mib: o.memoryMib,
      },
    });
    return new Sandbox(this.t, r.id, r.template, r.endpoints);
  }

  /** The sandbox `id` (404 `not_found` if it is not the tenant's or is gone). */
  async get(id: string): Promise<Sandbox> {
    const info = await new Sandbox(this.t, id).info();
    return new Sandbox(this.t, info.id, info.template, info.endpoints);
  }

  /** A handle on `id` without asking the service (calls on it fail if it does not exist). */
  ref(id: string): Sandbox {
    return new Sandbox(this.t, id);
  }

  /**
   * The tenant's live sandboxes matching `o` (id, template and state), oldest first: every page,
   * followed to the last. For a tenant with many, `pages` reads them a page at a time.
   */
  async list(o: SandboxListOptions = {}): Promise<SandboxSummary[]> {
    return allRows(this.pages(o));
  }

  /** One page of the list: after `cursor` (a previous page's `nextCursor`, with the same filters). */
  async page(o: SandboxListOptions = {}, cursor?: string): Promise<Page<SandboxSummary>> {
    const labels = labelQuery(o.labels);
    const r = await this.t.json<{ sandboxes: SandboxSummary[]; next_cursor?: string | null }>(
      "GET",
      "/v1/sandboxes",
      { query: { label: labels, state: o.state, template: o.template, limit: o.limit, cursor } },
    );
    // A service older than paged lists answers every row and no `next_cursor`: one page.
    return { items: r.sandboxes, nextCursor: r.next_cursor ?? null };
  }

  /** Every page of the list in order, each fetched when the loop asks for it. */
  async *pages(o: SandboxListOptions = {}): AsyncGenerator<Page<SandboxSummary>> {
    yield* followPages((cursor) => this.page(o, cursor));
  }
}

/** Filters of `client.snapshots.list` (docs/lists.md), all AND-ed. */
export interface SnapshotListOptions {
  /** Pairs every snapshot must hold (at most 16; a key must not hold `:`). */
  labels?: Record<string, string>;
  state?: "creating" | "ready" | "failed" | "lost";
  /** Only snapshots taken of this sandbox. */
  sourceSandbox?: string;
  /** Only snapshots whose source had this template id. */
  template?: string;
  /** Rows per page, 1 to 200. */
  limit?: number;
}

/** `client.snapshots`: the tenant's kept snapshots (`Sandbox.snapshot()` takes one). */
export class Snapshots {
  constructor(private readonly t: Transport) {}

  /**
   * The tenant's snapshots matching `o` (all AND-ed), newest first: every page, followed to the
   * last (`limit` is the page size, 1 to 200; the service's default 50).
   */
  async list(o: SnapshotListOptions = {}): Promise<SnapshotInfo[]> {
    return allRows(this.pages(o));
  }

  /** One page of the list: after `cursor` (a previous page's `nextCursor`, with the same filters). */
  async page(o: SnapshotListOptions = {}, cursor?: string): Promise<Page<SnapshotInfo>> {
    const labels = labelQuery(o.labels);
    const r = await this.t.json<{ snapshots: SnapshotInfo[]; next_cursor?: string | null }>(
      "GET",
      "/v1/snapshots",
      {
        query: {
          label: labels,
          state: o.state,
          source_sandbox: o.sourceSandbox,
          template: o.template,
          limit: o.limit,
          cursor,
        },
      },
    );
    // A service older than paged snapshot lists answers one capped list and no `next_cursor`.
    return { items: r.snapshots, nextCursor: r.next_cursor ?? null };
  }

  /** Every page of the list in order, each fetched when the loop asks for it. */
  async *pages(o: SnapshotListOptions = {}): AsyncGenerator<Page<SnapshotInfo>> {
    yield* followPages((cursor) => this.page(o, cursor));
  }

  /** The snapshot `id` (404 `not_found` if it is not the tenant's or was deleted). */
  get(id: string): Promise<SnapshotInfo> {
    return this.t.json("GET", `/v1/snapshots/${encodeURIComponent(id)}`);
  }

  /** Deletes it; sandboxes started from it run on. */
  async delete(id: string): Promise<void> {
    await this.t.json("DELETE", `/v1/snapshots/${encodeURIComponent(id)}`);
  }
}

export class Sessions {
  constructor(private readonly t: Transport) {}

  /** The sessions API: a session of `templateId`, kept until deleted or idle past its TTL. */
  async create(o: { templateId: string; idleTimeoutSeconds?: number }): Promise<Session> {
    const r = await this.t.json<{ session_id: string; template_id: string }>("POST", "/v1/sessions", {
      json: { template_id: o.templateId, idle_timeout_seconds: o.idleTimeoutSeconds },
    });
    return new Session(this.t, r.session_id, r.template_id);
  }

  async get(id: string): Promise<Session> {
    const s = await new Session(this.t, id).info();
    return new Session(this.t, s.session_id, s.template_id);
  }

  ref(id: string): Session {
    return new Session(this.t, id);
  }

  /** The tenant's live sessions matching `o`, oldest first: every page, followed to the last. */
  async list(o: SessionListOptions = {}): Promise<SessionSummary[]> {
    return allRows(this.pages(o));
  }

  /** One page of the list: after `cursor` (a previous page's `nextCursor`, with the same filters). */
  async page(o: SessionListOptions = {}, cursor?: string): Promise<Page<SessionSummary>> {
    const r = await this.t.json<{ sessions: SessionSummary[]; next_cursor?: string | null }>(
      "GET",
      "/v1/sessions",
      { query: { template_id: o.templateId, limit: o.limit, cursor } },
    );
    return { items: r.sessions, nextCursor: r.next_cursor ?? null };
  }

  /** Every page of the list in order, each fetched when the loop asks for it. */
  async *pages(o: SessionListOptions = {}): AsyncGenerator<Page<SessionSummary>> {
    yield* followPages((cursor) => this.page(o, cursor));
  }
}

/** Templates of both APIs: the key decides which form the service answers. */
export class Templates {
  constructor(private readonly t: Transport) {}

  /** Every template the key may use. */
  async list(): Promise<TemplateSummary[]> {
    const r = await this.t.json<{ templates: CatalogEntry[] | Record<string, { ready: boolean }> }>(
      "GET",
      "/v1/templates",
    );
    if (Array.isArray(r.templates)) return r.templates;
    return Object.entries(r.templates).map(([id, v]) => ({ id, ready: v.ready }));
  }

  /** The sessions API: `{id, status, error?}`; The sandboxes API: `{id, phase, error?, telemetry, ...}`. */
  get(id: string): Promise<Template> {
    return this.t.json("GET", `/v1/templates/${encodeURIComponent(id)}`);
  }

  /**
   * The sandboxes API (Pro): bakes `image` from its registry into a template named `name`; answers at once
   * (phase `Pending`). The service treats the same request again as the same bake, so this call
   * is retried on 429/503 like an idempotent one.
   */
  bake(o: BakeOptions): Promise<TemplateB> {
    return this.t.json("POST", "/v1/templates", {
      json: {
        name: o.name,
        image: o.image,
        registry_auth: o.registryAuth,
        ready: o.ready,
        width: o.width,
        expected_width: o.expectedWidth,
        sizes: o.sizes,
      },
      retry: true,
    });
  }

  /** The sessions API (scale key): registers an uploaded image archive as template `id`; builds in the background. */
  upload(o: UploadOptions): Promise<{ id: string; status: "building" }> {
    return this.t.json("POST", "/v1/templates", {
      query: { id: o.id, mem_mib: o.memMib, vcpu_count: o.vcpuCount, wait_secs: o.waitSecs },
      body: o.image,
      timeoutMs: 0,
    });
  }

  /**
   * Polls until the template is usable (`Live`, or `ready`) and returns it; a failed bake or
   * build throws `template_failed` with the service's reason.
   */
  async wait(id: string, o: WaitOptions = {}): Promise<Template> {
    const deadline = Date.now() + (o.timeoutMs ?? this.t.o.timeoutMs);
    for (;;) {
      const t = await this.get(id);
      o.onProgress?.(t);
      const phase = "phase" in t ? t.phase : t.status;
      if (phase === "Live" || phase === "ready") return t;
      if (phase === "Failed" || phase === "failed") {
        throw new SandboxdError({
          code: "template_failed",
          status: 200,
          message: `template ${id}: ${(t as TemplateA | TemplateB).error ?? "failed"}`,
        });
      }
      if (Date.now() > deadline) {
        throw new SandboxdError({ code: "timeout", status: 0, message: `template ${id} is still ${phase}` });
      }
      await sleep(TEMPLATE_POLL_MS);
    }
  }

  async delete(id: string): Promise<void> {
    await this.t.json("DELETE", `/v1/templates/${encodeURIComponent(id)}`);
  }

  /** The sandboxes API (Pro): keep `width` restored VMs of the template ready for creates. */
  async expect(id: string, width: number): Promise<void> {
    await this.t.json("POST", `/v1/templates/${encodeURIComponent(id)}/expect`, { json: { width } });
  }

  /** The sandboxes API (Pro): drop the template's pool of ready VMs. */
  async release(id: string): Promise<void> {
    await this.t.json("POST", `/v1/templates/${encodeURIComponent(id)}/release`);
  }
}

/**
 * The SDK's one way to the service: `fetch` with the key, the error envelope turned into
 * `SandboxdError`, a deadline per call, and retries of 429 and 503 with backoff that honours
 * `Retry-After`. Nothing here is specific to one runtime: Bun, Node >= 20 and Deno all give
 * `fetch`, `AbortSignal.timeout`/`any`-free abort plumbing and `ReadableStream`.
 */
import { errorFromAnswer, SandboxdError } from "./errors.ts";

export interface RetryOptions {
  /** Retries after the first attempt (0 = none). Default 3. */
  maxRetries?: number;
  /** First backoff step, ms, doubled per retry (full jitter). Default 500. */
  baseDelayMs?: number;
  /**
   * The longest single wait, ms. A `Retry-After` longer than this is not waited out: the call
   * fails at once with `retryAfterSeconds` for the caller to schedule. Default 30 000.
   */
  maxDelayMs?: number;
  /**
   * Retry calls that are not idempotent (POST: create, exec, fork, ...) too. Off by default: a
   * 503 from a proxy may come after the service acted. A single call can ask with `retry: true`.
   */
  nonIdempotent?: boolean;
}

export interface TransportOptions {
  baseUrl: string;
  apiKey?: string | undefined;
  /** Deadline of one ordinary call, ms (streams: until the answer's headers). */
  timeoutMs: number;
  retry: Required<RetryOptions> | false;
  fetch: Fetch;
  /** Waits `ms`; tests pass a recorder. */
  sleep: (ms: number) => Promise<void>;
  /** Backoff jitter in [0, 1). */
  random: () => number;
}

/** The part of `fetch` the SDK uses (a proxy agent's or a recorder's fetch fits). */
export type Fetch = (input: URL, init: RequestInit) => Promise<Response>;

export type Body = string | Uint8Array | ArrayBuffer | Blob | ReadableStream<Uint8Array>;

export interface CallOptions {
  /** An array is the parameter repeated, once per value (`label=a:1&label=b:2`). */
  query?: Record<string, string | number | boolean | string[] | undefined> | undefined;
  /** A JSON value, sent as `application/json`. */
  json?: unknown;
  /** A raw body, sent as `application/octet-stream` unless `headers` say otherwise. */
  body?: Body | undefined;
  headers?: Record<string, string>;
  /** Overrides the client's deadline for this call, ms; 0 = none. */
  timeoutMs?: number | undefined;
  /** `true` retries this call on 429/503 even if it is not idempotent; `false` never retries it. */
  retry?: boolean | undefined;
  signal?: AbortSignal | undefined;
}

const IDEMPOTENT = new Set(["GET", "HEAD", "PUT", "DELETE", "OPTIONS"]);

/** Statuses worth another try: the service (or its database, or capacity) is busy for now. */
const RETRIED_STATUS = new Set([429, 503]);

export class Transport {
  constructor(readonly o: TransportOptions) {}

  url(path: string, query?: CallOptions["query"]): URL {
    const url = new URL(
      path.replace(/^\//, ""),
      this.o.baseUrl.endsWith("/") ? this.o.baseUrl : `${this.o.baseUrl}/`,
    );
    for (const [k, v] of Object.entries(query ?? {})) {
      if (Array.isArray(v)) for (const one of v) url.searchParams.append(k, one);
      else if (v !== undefined) url.searchParams.set(k, String(v));
    }
    return url;
  }

  authHeaders(): Record<string, string> {
    return this.o.apiKey ? { authorization: `Bearer ${this.o.apiKey}` } : {};
  }

  /** A JSON call: the parsed body of a 2xx answer (undefined for an empty one), else throws. */
  async json<T>(method: string, path: string, opts: CallOptions = {}): Promise<T> {
    const res = await this.send(method, path, opts);
    const text = await readText(res);
    if (text === "") return undefined as T;
    try {
      return JSON.parse(text) as T;
    } catch (cause) {
      throw new SandboxdError({
        code: "protocol",
        status: res.status,
        message: `${method} ${path}: the answer is not JSON: ${text.slice(0, 200)}`,
        cause,
      });
    }
  }

  /**
   * Sends the call and returns a 2xx `Response` with its body unread (downloads, event streams);
   * a non-2xx answer is read and thrown. Retries per the options. The deadline covers the wait for
   * the answer's headers; the returned body is then the caller's, until `signal` aborts it.
   */
  async send(method: string, path: string, opts: CallOptions = {}): Promise<Response> {
    const retry = this.o.retry;
    const replayable = !(opts.body instanceof ReadableStream);
    const mayRetry =
      retry !== false &&
      opts.retry !== false &&
      replayable &&
      (opts.retry === true || retry.nonIdempotent || IDEMPOTENT.has(method));
    for (let attempt = 0; ; attempt++) {
      const res = await this.once(method, path, opts);
      if (res.ok) return res;
      const err = errorFromAnswer(res.status, res.headers, await readText(res).catch(() => ""));
      if (!mayRetry) throw err;
      if (!RETRIED_STATUS.has(res.status) || attempt >= retry.maxRetries) throw err;
      const backoff = retry.baseDelayMs * 2 ** attempt * this.o.random();
      const wait = err.retryAfterSeconds !== undefined ? err.retryAfterSeconds * 1000 : backoff;
      if (wait > retry.maxDelayMs) throw err;
      if (opts.signal?.aborted) throw aborted(method, path, opts.signal.reason);
      await this.o.sleep(wait);
    }
  }

  private async once(method: string, path: string, opts: CallOptions): Promise<Response> {
    const headers: Record<string, string> = { ...this.authHeaders(), ...opts.headers };
    let body: RequestInit["body"];
    if (opts.json !== undefined) {
      headers["content-type"] ??= "application/json";
      body = JSON.stringify(opts.json);
    } else if (opts.body !== undefined) {
      headers["content-type"] ??= "application/octet-stream";
      body = opts.body as RequestInit["body"];
    }
    const timeoutMs = opts.timeoutMs ?? this.o.timeoutMs;
    const ctl = new AbortController();
    const onAbort = () => ctl.abort(opts.signal?.reason);
    opts.signal?.addEventListener("abort", onAbort, { once: true });
    if (opts.signal?.aborted) onAbort();
    let timedOut = false;
    const timer =
      timeoutMs > 0
        ? setTimeout(() => {
            timedOut = true;
            ctl.abort();
          }, timeoutMs)
        : undefined;
    const init: RequestInit & { duplex?: "half" } = { method, headers, body, signal: ctl.signal };
    // Node's fetch sends a stream body only when told it is half-duplex (the others ignore it).
    if (body instanceof ReadableStream) init.duplex = "half";
    try {
      return await this.o.fetch(this.url(path, opts.query), init);
    } catch (cause) {
      if (timedOut) {
        throw new SandboxdError({
          code: "timeout",
          status: 0,
          message: `${method} ${path}: no answer within ${timeoutMs} ms`,
          cause,
        });
      }
      if (opts.signal?.aborted) throw aborted(method, path, cause);
      throw new SandboxdError({
        code: "network",
        status: 0,
        message: `${method} ${path}: ${cause instanceof Error ? cause.message : String(cause)}`,
        cause,
      });
    } finally {
      clearTimeout(timer);
      // The caller's signal keeps aborting the body it reads (streams): left attached on purpose.
    }
  }
}

function aborted(method: string, path: string, cause: unknown): SandboxdError {
  return new SandboxdError({ code: "aborted", status: 0, message: `${method} ${path}: aborted`, cause });
}

/** The body as text; a body cut off midway is a `network` error rather than a TypeError. */
async function readText(res: Response): Promise<string> {
  try {
    return await res.text();
  } catch (cause) {
    throw new SandboxdError({
      code: "network",
      status: res.status,
      message: `the answer was cut off: ${cause instanceof Error ? cause.message : String(cause)}`,
      cause,
    });
  }
}

/** Default retry policy (documented on RetryOptions). */
export const DEFAULT_RETRY: Required<RetryOptions> = {
  maxRetries: 3,
  baseDelayMs: 500,
  maxDelayMs: 30_000,
  nonIdempotent: false,
};

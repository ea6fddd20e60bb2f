/**
 * The API as the console calls it: `Authorization: Bearer <key>` on every request, the key
 * passed in (it lives in sessionStorage, app.js), never in a URL. Errors are `ApiError` with the
 * service's `code`, HTTP status and message.
 */
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** An API client for one key. */
export function apiFor(key) {
  async function call(method, path, body) {
    const headers = { authorization: `Bearer ${key}` };
    if (body !== undefined) headers["content-type"] = "application/json";
    const res = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
      credentials: "omit",
    });
    const text = await res.text();
    let parsed;
    try {
      parsed = text.length > 0 ? JSON.parse(text) : undefined;
    } catch {
      parsed = undefined;
    }
    if (!res.ok) {
      throw new ApiError(res.status, parsed?.code ?? "http_error", parsed?.message ?? `HTTP ${res.status}`);
    }
    return parsed;
  }
  return {
    get: (path) => call("GET", path),
    post: (path, body) => call("POST", path, body ?? {}),
    del: (path) => call("DELETE", path),
  };
}

/** Runs `fn` over `items`, at most `width` at a time (the per-key rate limit is shared). */
export async function mapLimited(items, width, fn) {
  const out = new Array(items.length);
  let next = 0;
  async function worker() {
    while (next < items.length) {
      const i = next++;
      out[i] = await fn(items[i], i);
    }
  }
  await Promise.all(Array.from({ length: Math.min(width, items.length) }, worker));
  return out;
}

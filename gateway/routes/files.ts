/**
 * The file API of sandboxes API sandboxes and sessions API sessions (docs/files.md "The file API"):
 * `PUT|GET|DELETE /v1/{sandboxes|sessions}/{id}/files?path=` and `GET ...&list=true`. Each call
 * is counted in flight on the record like an exec (`beginUse`), so no reaper takes the sandbox
 * mid-transfer and its idleness restarts at the end; a sandbox the service suspended for idleness
 * is resumed first (`wakeIfIdle`). Bodies stream end to end: the gateway holds no more of a file
 * than its transport buffers, the agent none beyond one guest frame.
 */
import { type Context, Hono, type MiddlewareHandler } from "hono";
import { FilesQuery } from "../../contracts/api/files.ts";
import { MAX_FILE_TRANSFER_BYTES } from "../../contracts/api/limits.ts";
import type { KeyApi } from "../../contracts/api/tiers.ts";
import { bestEffort, settled } from "../../contracts/best-effort.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { requireApiMw } from "../auth/guards.ts";
import type { KeyConnection } from "../auth/key-connections.ts";
import { wakeIfIdle } from "../core/idle.ts";
import { beginUse, inTermsOf } from "../core/sandboxes.ts";
import type { Deps, HonoEnv } from "../deps.ts";
import { holdForKey, logOf } from "../deps.ts";
import { query } from "../http.ts";

export const tooLarge = () =>
  new SandboxdError("payload_too_large", `a file upload is limited to ${MAX_FILE_TRANSFER_BYTES} bytes`);

/**
 * The upload body, counted: past the limit the stream fails (the agent then cancels the write and
 * the guest drops its temp file) and `over` says why the call failed.
 */
export function limited(body: ReadableStream<Uint8Array> | null): {
  stream: ReadableStream<Uint8Array>;
  over: () => boolean;
} {
  let total = 0;
  const counter = new TransformStream<Uint8Array, Uint8Array>({
    transform(chunk, ctl) {
      total += chunk.byteLength;
      if (total > MAX_FILE_TRANSFER_BYTES) ctl.error(tooLarge());
      else ctl.enqueue(chunk);
    },
  });
  if (!body) {
    void counter.writable.close();
    return { stream: counter.readable, over: () => false };
  }
  // A failed pipe errors `counter.readable`, which the upload reads: the error reaches the call.
  void settled(body.pipeTo(counter.writable));
  return { stream: counter.readable, over: () => total > MAX_FILE_TRANSFER_BYTES };
}

/**
 * `stream` with `end` called once it finishes, fails or is cancelled by the reader; an `end` that
 * fails (the call's end written to the database) is logged: the download itself went through.
 * Held under the caller's key while it lasts (`hold`, auth/key-connections.ts): revoking the key
 * fails the body (the client sees the transfer cut short) and cancels the agent's read.
 */
export function onFinish(
  stream: ReadableStream<Uint8Array>,
  end: () => Promise<void>,
  log: (line: string) => void,
  hold: (conn: KeyConnection) => () => void,
): ReadableStream<Uint8Array> {
  const reader = stream.getReader();
  let unhold = () => {};
  const done = () => {
    unhold();
    void bestEffort(log, "ending the download's call", end);
  };
  return new ReadableStream<Uint8Array>(
    {
      start(ctl) {
        unhold = hold({
          close: (_code, reason) => {
            const err = new SandboxdError("unauthorized", reason);
            ctl.error(err);
            // The agent's body repeats the cause of its own cancel.
            void settled(reader.cancel(err));
            done();
          },
        });
      },
      async pull(ctl) {
        try {
          const r = await reader.read();
          if (r.done) {
            done();
            ctl.close();
          } else ctl.enqueue(r.value);
        } catch (err) {
          done();
          ctl.error(err);
        }
      },
      cancel(reason) {
        done();
        return reader.cancel(reason);
      },
    },
    // Nothing read ahead of the client: back-pressure reaches the agent and the guest.
    { highWaterMark: 0 },
  );
}

function handlers(deps: Deps) {
  /** The record, checked and counted in flight; `end` once the call is over. */
  const begin = async (c: Context<HonoEnv>) => {
    const p = c.get("principal");
    const q = query(c, FilesQuery);
    const id = c.req.param("id")!;
    await wakeIfIdle(deps, p, id);
    const use = await beginUse(deps, p, id);
    const call = { path: q.path, ...(q.user !== undefined ? { user: q.user } : {}) };
    return { ...use, q, call };
  };

  const put = async (c: Context<HonoEnv>) => {
    const u = await begin(c);
    const body = limited(c.req.raw.body);
    try {
      const a = await inTermsOf(
        u.row,
        u.agent.files(u.row.vmId!, { ...u.call, op: "upload", body: body.stream, signal: c.req.raw.signal }),
      );
      if (a.op !== "upload")
        throw new SandboxdError("internal", "the agent answered an upload with something else");
      return c.json(a.written);
    } catch (err) {
      if (body.over()) throw tooLarge();
      throw err;
    } finally {
      await u.end();
    }
  };

  const get = async (c: Context<HonoEnv>) => {
    const u = await begin(c);
    let handedOver = false;
    try {
      if (u.q.list === "true") {
        const a = await inTermsOf(u.row, u.agent.files(u.row.vmId!, { ...u.call, op: "list" }));
        if (a.op !== "list")
          throw new SandboxdError("internal", "the agent answered a list with something else");
        return c.json(a.list);
      }
      const a = await inTermsOf(
        u.row,
        u.agent.files(u.row.vmId!, { ...u.call, op: "download", signal: c.req.raw.signal }),
      );
      if (a.op !== "download")
        throw new SandboxdError("internal", "the agent answered a download with something else");
      handedOver = true;
      const hold = (conn: KeyConnection) => holdForKey(deps, c.get("principal").keyId, conn);
      return new Response(onFinish(a.body, u.end, logOf(deps), hold), {
        headers: { "content-type": "application/octet-stream" },
      });
    } finally {
      if (!handedOver) await u.end();
    }
  };

  const del = async (c: Context<HonoEnv>) => {
    const u = await begin(c);
    try {
      await inTermsOf(u.row, u.agent.files(u.row.vmId!, { ...u.call, op: "remove" }));
      return c.json({ deleted: true as const, path: u.call.path });
    } finally {
      await u.end();
    }
  };
  return { put, get, del };
}

/** A declared upload size over the limit is refused first, before the key's API is checked. */
const declaredSize: MiddlewareHandler<HonoEnv> = async (c, next) => {
  const declared = c.req.header("content-length");
  if (declared !== undefined && Number(declared) > MAX_FILE_TRANSFER_BYTES) throw tooLarge();
  await next();
};

/** Mounted at `/v1/sandboxes` and at `/v1/sessions`, each with its own API. */
export function fileRoutes(deps: Deps, api: KeyApi): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  const only = requireApiMw(api);
  const h = handlers(deps);
  app.put("/:id/files", declaredSize, only, h.put);
  app.get("/:id/files", only, h.get);
  app.delete("/:id/files", only, h.del);
  return app;
}

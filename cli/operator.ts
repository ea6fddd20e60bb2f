/**
 * Operator commands (`sandboxd key`, `sandboxd agent-token`, ...) run where the database is. A
 * running service (`up`, `gateway`) listens on an operator socket in its data dir,
 * `<data>/operator/sandboxd.sock` (a unix socket, never TCP: in a 0700 directory, the socket
 * itself 0600, both owned by the service's user), and runs the command on its own database
 * handle: over PGlite that is the only way in while it runs (one process per PGlite directory,
 * db/lock.ts), and the service sees what the command changed at once. With no service answering,
 * the CLI opens the database itself (PGlite in the data dir, or DATABASE_URL) and runs the same
 * command there. `runOperatorOp` is that choice, for any command defined with `operatorOp`.
 *
 * The protocol is one HTTP request per command on the socket: `POST /op/<name>` with the JSON
 * arguments; the answer is `{ok: true, result}` or `{ok: false, code, message}`.
 */
import { chmodSync, existsSync, mkdirSync, unlinkSync } from "node:fs";
import { join } from "node:path";
import { z } from "zod";
import { describeError, type ErrorCode, SandboxdError } from "../contracts/errors.ts";
import type { Db } from "../db/client.ts";
import { type GatewaySecrets, loadSecrets } from "../gateway/auth/secrets.ts";
import { withGatewayDb } from "./gateway-db.ts";
import { operatorSecrets } from "./settings.ts";

/** What an operator command runs with: the gateway's database and its secrets. */
export interface OperatorContext {
  db: Db;
  secrets: GatewaySecrets;
  /** The serving gateway's hook for a key just revoked (its key cache); absent with no service. */
  keyRevoked?: (keyId: string) => void;
  /**
   * The serving gateway's `--region`: the home of a tenant, and the region of an enrollment token,
   * created without `--region`. Absent with no service: a new tenant then has no home until one is
   * named (served in the serving gateway's region) and a token enrolls into `local`.
   */
  defaultRegion?: string;
}

/** One operator command: its arguments' schema and what it does. Results are plain JSON. */
export interface OperatorOp<A, R> {
  args: z.ZodType<A>;
  run(ctx: OperatorContext, args: A): Promise<R>;
}

export function operatorOp<A, R>(args: z.ZodType<A>, run: (ctx: OperatorContext, args: A) => Promise<R>) {
  return { args, run } satisfies OperatorOp<A, R>;
}

// biome-ignore lint/suspicious/noExplicitAny: a registry holds commands of every argument type.
export type OperatorOps = Record<string, OperatorOp<any, unknown>>;

export function operatorSocketPath(dataDir: string): string {
  return join(dataDir, "operator", "sandboxd.sock");
}

/** A command runs in milliseconds; 30 s bounds a service that accepted and then hung. */
const CALL_TIMEOUT_MS = 30_000;
/** sun_path holds 108 bytes with its terminating NUL (Linux unix(7)). */
const MAX_SOCKET_PATH = 107;

type Answer = { ok: true; result: unknown } | { ok: false; code: ErrorCode; message: string };

/**
 * Sends one command to the service on `path`. Undefined when nothing answers there (no socket, or
 * a stale one whose service is gone); the command's own failure is thrown as its SandboxdError.
 */
async function callSocket(
  path: string,
  name: string,
  args: unknown,
): Promise<{ result: unknown } | undefined> {
  if (!existsSync(path)) return undefined;
  let res: Response;
  try {
    res = await fetch(`http://sandboxd/op/${encodeURIComponent(name)}`, {
      unix: path,
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(args ?? {}),
      signal: AbortSignal.timeout(CALL_TIMEOUT_MS),
    } as RequestInit);
  } catch (err) {
    if ((err as Error).name === "TimeoutError") {
      throw new SandboxdError("internal", `the service on ${path} did not answer in ${CALL_TIMEOUT_MS} ms`);
    }
    return undefined; // refused: the socket file outlived its service
  }
  const answer = (await res.json()) as Answer;
  if (!answer.ok) throw new SandboxdError(answer.code, answer.message);
  return { result: answer.result };
}

type ArgsOf<T> = T extends OperatorOp<infer A, unknown> ? A : never;
// biome-ignore lint/suspicious/noExplicitAny: only the result type is read here.
type ResultOf<T> = T extends OperatorOp<any, infer R> ? R : never;

/**
 * Runs operator command `name` of `ops` for the data dir: in the running service when its
 * operator socket answers, else here on the database (PGlite in `dataDir`, or DATABASE_URL). Over
 * PGlite a service that holds the directory without answering (still starting) makes opening it
 * fail with a message that names the holder and what to do.
 */
export async function runOperatorOp<O extends OperatorOps, K extends keyof O & string>(
  dataDir: string,
  ops: O,
  name: K,
  args: ArgsOf<O[K]>,
): Promise<ResultOf<O[K]>> {
  const op = ops[name]!;
  const parsed = op.args.parse(args);
  const remote = await callSocket(operatorSocketPath(dataDir), name, parsed);
  if (remote) return remote.result as ResultOf<O[K]>;
  const secrets = loadSecrets(dataDir, operatorSecrets());
  const result = await withGatewayDb(dataDir, (db) => op.run({ db, secrets }, parsed)).catch((err) => {
    if (err instanceof SandboxdError && err.code === "conflict" && typeof err.details?.pid === "number") {
      throw new SandboxdError(
        "conflict",
        `${err.message}. Its operator socket ${operatorSocketPath(dataDir)} does not answer: if it is ` +
          "`sandboxd up` or `sandboxd gateway` still starting, retry once it prints `listening`",
        { details: err.details },
      );
    }
    throw err;
  });
  // Through JSON as over the socket, so both paths hand back the same shape.
  return JSON.parse(JSON.stringify(result ?? null)) as ResultOf<O[K]>;
}

export interface OperatorSocket {
  path: string;
  stop(): Promise<void>;
}

/**
 * Serves `ops` on `<dataDir>/operator/sandboxd.sock` with the service's own database handle
 * (`withDb`) and secrets. Undefined, with a log line, when another live service already answers
 * there (several gateways sharing one data dir over PostgreSQL: the CLI reaches the first) or
 * the path is too long for a unix socket.
 */
export async function startOperatorSocket(opts: {
  dataDir: string;
  ops: OperatorOps;
  withDb: <T>(fn: (db: Db) => Promise<T>) => Promise<T>;
  /** Told of each key the socket revokes (OperatorContext.keyRevoked). */
  keyRevoked?: (keyId: string) => void;
  /** The serving gateway's `--region` (OperatorContext.defaultRegion). */
  defaultRegion?: string;
  secrets: GatewaySecrets;
  log: (line: string) => void;
}): Promise<OperatorSocket | undefined> {
  const dir = join(opts.dataDir, "operator");
  const path = operatorSocketPath(opts.dataDir);
  if (Buffer.byteLength(path) > MAX_SOCKET_PATH) {
    opts.log(
      `operator socket: ${path} is too long for a unix socket; operator commands need the service stopped`,
    );
    return undefined;
  }
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  chmodSync(dir, 0o700); // also when it existed with a looser mode
  if (existsSync(path)) {
    const live = await fetch("http://sandboxd/ping", {
      unix: path,
      signal: AbortSignal.timeout(2000),
    } as RequestInit)
      .then(() => true)
      .catch(() => false);
    if (live) {
      opts.log(`operator socket: another service answers on ${path}; not serving one here`);
      return undefined;
    }
    unlinkSync(path); // left by a service that is gone
  }
  const server = Bun.serve({
    unix: path,
    fetch: async (req) => {
      const url = new URL(req.url);
      if (url.pathname === "/ping") return Response.json({ ok: true, result: "sandboxd" });
      const name = decodeURIComponent(url.pathname.replace(/^\/op\//, ""));
      const op = req.method === "POST" && url.pathname.startsWith("/op/") ? opts.ops[name] : undefined;
      if (!op) return Response.json({ ok: false, code: "not_found", message: `no operator command ${name}` });
      try {
        const args = op.args.parse(await req.json());
        const result = await opts.withDb((db) =>
          op.run(
            {
              db,
              secrets: opts.secrets,
              ...(opts.keyRevoked ? { keyRevoked: opts.keyRevoked } : {}),
              ...(opts.defaultRegion !== undefined ? { defaultRegion: opts.defaultRegion } : {}),
            },
            args,
          ),
        );
        opts.log(`operator: ${name} done`);
        return Response.json({ ok: true, result: result ?? null });
      } catch (err) {
        const code: ErrorCode =
          err instanceof SandboxdError ? err.code : err instanceof z.ZodError ? "bad_request" : "internal";
        opts.log(`operator: ${name} failed: ${describeError(err)}`);
        return Response.json({ ok: false, code, message: err instanceof Error ? err.message : String(err) });
      }
    },
  });
  chmodSync(path, 0o600);
  return {
    path,
    async stop() {
      await server.stop(true);
      try {
        unlinkSync(path);
      } catch {
        // already gone
      }
    },
  };
}

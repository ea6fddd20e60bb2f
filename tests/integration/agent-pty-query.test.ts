/**
 * A terminal's options on the agent's API (contracts/agent/pty.ts, docs/agent-api.md "Tunnels"):
 * the gateway's real client (AgentHttpClient.openPty, `ws`) against the agent's real HTTP app
 * under Bun.serve, whose manager records what reached it and answers 409 "reached the manager".
 * Options round-trip exactly (unicode, spaces, `=`, empty arguments); the largest options the
 * bounds allow fit under Bun's request header limit; options past a bound are refused by the
 * client before any call; hostile query strings sent straight to the agent are 400. No VMs.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createAgentApp } from "../../agent/api/app.ts";
import { type TunnelSocketData, tunnelWebSocket } from "../../agent/api/tunnel-ws.ts";
import type { SandboxManager } from "../../agent/sandbox/manager.ts";
import { AGENT_API_PREFIX } from "../../contracts/agent/api.ts";
import {
  MAX_PTY_ARGV,
  MAX_PTY_ARGV_BYTES,
  MAX_PTY_CWD_BYTES,
  MAX_PTY_ENV_BYTES,
  type PtyOpen,
} from "../../contracts/agent/pty.ts";
import { secretKey, signAgentToken } from "../../contracts/agent/token.ts";
import { MAX_EXEC_USER_CHARS } from "../../contracts/api/limits.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { AgentHttpClient } from "../../gateway/agents/client.ts";

const CREDS = { id: "pty-agent", key: "pty-test-key-0123456789abcdef0123456789" };
const VM = "vm-pty-query";
let dir: string;
let app: ReturnType<typeof createAgentApp>;
let server: ReturnType<typeof Bun.serve<TunnelSocketData>>;
let client: AgentHttpClient;
/** The options each openPty call brought to the manager. */
const reached: { vmId: string; opts: PtyOpen }[] = [];

beforeAll(() => {
  dir = mkdtempSync(join(tmpdir(), "sbx-pty-query-"));
  const manager = {
    openPty(vmId: string, opts: PtyOpen) {
      reached.push({ vmId, opts });
      throw new SandboxdError("conflict", "reached the manager");
    },
  } as unknown as SandboxManager;
  app = createAgentApp({ manager, credentials: CREDS, uploadDir: join(dir, "uploads") });
  server = Bun.serve<TunnelSocketData>({
    hostname: "127.0.0.1",
    port: 0,
    fetch: (req, srv) => app.fetch(req, srv),
    websocket: tunnelWebSocket,
  });
  client = new AgentHttpClient({
    baseUrl: `http://127.0.0.1:${server.port}`,
    agentId: CREDS.id,
    key: CREDS.key,
  });
});
afterAll(async () => {
  await server.stop(true);
  rmSync(dir, { recursive: true, force: true });
});

/** Opens through the real client; answers what the manager saw (the call itself ends in 409). */
async function through(opts: PtyOpen): Promise<PtyOpen> {
  const before = reached.length;
  const err = await client.openPty(VM, opts).then(
    () => undefined,
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(SandboxdError);
  expect((err as SandboxdError).code).toBe("conflict");
  expect(reached.length).toBe(before + 1);
  expect(reached.at(-1)!.vmId).toBe(VM);
  return reached.at(-1)!.opts;
}

test("options round-trip exactly through the client's query and the agent's parser", async () => {
  const opts: PtyOpen = {
    cols: 132,
    rows: 43,
    argv: ["/bin/bash", "-i", "-l", "", "a b=c", "é\u2603\t\x1b[0m%&?#"],
    env: { ABC: "123", TERM: "xterm-256color", LANG: "C.UTF-8", EMPTY: "", EQ: "a=b=c", U: "ü\n\u2603&=+%" },
    cwd: "/tmp/with space/é&?#%",
    user: "root",
  };
  expect(await through(opts)).toEqual(opts);
  // Only the size: nothing else appears.
  expect(await through({ cols: 1, rows: 65535 })).toEqual({ cols: 1, rows: 65535 });
});

test("the largest options the bounds allow fit under the agent server's header limit", async () => {
  // env exactly at its byte bound: names + values + 2 per entry.
  const value = "v".repeat(MAX_PTY_ENV_BYTES - "BIG".length - 2);
  // argv exactly at its byte bound and count, every byte kept as it is (base64url: fixed size).
  const argv = Array.from({ length: MAX_PTY_ARGV }, () => "");
  argv[0] = "a".repeat(MAX_PTY_ARGV_BYTES - MAX_PTY_ARGV);
  // cwd of multi-byte characters only: every byte percent-encoded (three characters each).
  const cwd = `/${"é".repeat(Math.floor((MAX_PTY_CWD_BYTES - 1) / 2))}`;
  expect(Buffer.byteLength(cwd)).toBeLessThanOrEqual(MAX_PTY_CWD_BYTES);
  expect(Buffer.byteLength(cwd)).toBeGreaterThan(MAX_PTY_CWD_BYTES - 2);
  const opts: PtyOpen = {
    cols: 65535,
    rows: 65535,
    argv,
    env: { BIG: value },
    cwd,
    user: "u".repeat(MAX_EXEC_USER_CHARS),
  };
  expect(await through(opts)).toEqual(opts);
});

test("options past a bound are bad_request at the client, before the agent is called", async () => {
  const before = reached.length;
  const refused = async (opts: PtyOpen) => {
    const err = await client.openPty(VM, opts).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(SandboxdError);
    expect((err as SandboxdError).code).toBe("bad_request");
  };
  await refused({ cols: 80, rows: 24, env: { BIG: "v".repeat(MAX_PTY_ENV_BYTES - "BIG".length - 1) } });
  await refused({ cols: 80, rows: 24, argv: Array.from({ length: MAX_PTY_ARGV + 1 }, () => "x") });
  await refused({ cols: 80, rows: 24, argv: ["a".repeat(MAX_PTY_ARGV_BYTES)] });
  await refused({ cols: 80, rows: 24, argv: [] });
  await refused({ cols: 80, rows: 24, argv: ["a\0b"] });
  await refused({ cols: 80, rows: 24, env: { "BAD-NAME": "x" } });
  await refused({ cols: 80, rows: 24, env: { A: "x\0y" } });
  await refused({ cols: 80, rows: 24, cwd: "relative" });
  await refused({ cols: 80, rows: 24, cwd: `/${"a".repeat(MAX_PTY_CWD_BYTES)}` });
  await refused({ cols: 80, rows: 24, user: "no body" });
  await refused({ cols: 0, rows: 24 });
  expect(reached.length).toBe(before);
});

/** One raw GET of the pty route on the app (no server: a query the parser accepts is 501 `unsupported`). */
async function raw(query: string): Promise<{ status: number; code: string }> {
  const token = await signAgentToken(secretKey(CREDS.key), CREDS.id);
  const res = await app.request(`${AGENT_API_PREFIX}/vms/${VM}/pty?${query}`, {
    headers: { authorization: `Bearer ${token}`, upgrade: "websocket" },
  });
  const body = (await res.json()) as { code: string };
  return { status: res.status, code: body.code };
}
const b64 = (s: string | Uint8Array) => Buffer.from(s).toString("base64url");

test("hostile query strings are 400 at the agent; well-formed ones pass its parser", async () => {
  const base = "cols=80&rows=24";
  // Well-formed: these get past the parser (to the upgrade step, which app.request cannot take).
  for (const ok of [
    base,
    `${base}&env=${b64("A=1\0B=\0")}`,
    `${base}&argv=${b64("\0")}`, // one empty argument
    `${base}&cwd=%2Ftmp&user=1000`,
    `${base}&cols=0`, // a repeated name: the first value counts
  ])
    expect(await raw(ok)).toEqual({ status: 501, code: "unsupported" });
  const hostile = [
    "cols=80",
    "cols=0&rows=24",
    "cols=65536&rows=24",
    "cols=abc&rows=24",
    "cols=1.5&rows=24",
    "cols=-1&rows=24",
    `${base}&env=`, // empty: no entry, no terminator
    `${base}&env=${b64("A=1")}`, // unterminated
    `${base}&env=${b64("A=1\0")}==`, // padding
    `${base}&env=${b64("A=1\0").replace(/-/g, "+")}!`, // not base64url
    `${base}&env=${b64("A=1\0").slice(0, -1)}B`, // non-canonical trailing bits
    `${base}&env=${b64(new Uint8Array([0x41, 0x3d, 0xff, 0xfe, 0x00]))}`, // not UTF-8
    `${base}&env=${b64("A=1\0\0")}`, // an empty entry
    `${base}&env=${b64("=1\0")}`, // no name
    `${base}&env=${b64("NOEQUALS\0")}`,
    `${base}&env=${b64("A=1\0A=2\0")}`, // a name twice
    `${base}&env=${b64("BAD-NAME=1\0")}`,
    `${base}&env=${b64("1A=1\0")}`,
    `${base}&env=${b64(`BIG=${"v".repeat(MAX_PTY_ENV_BYTES)}\0`)}`, // past the byte bound
    `${base}&env=${"A".repeat(20_000)}`, // past the encoded bound, never decoded
    `${base}&env=${b64(Array.from({ length: 257 }, (_, i) => `V${i}=\0`).join(""))}`, // past the entries bound
    `${base}&argv=`,
    `${base}&argv=${b64("sh")}`, // unterminated
    `${base}&argv=${b64("a\0".repeat(MAX_PTY_ARGV + 1))}`,
    `${base}&argv=${b64(`${"a".repeat(MAX_PTY_ARGV_BYTES)}\0`)}`,
    `${base}&cwd=tmp`,
    `${base}&cwd=`,
    `${base}&cwd=%2Ftmp%00x`,
    `${base}&cwd=%2F${"a".repeat(MAX_PTY_CWD_BYTES)}`,
    `${base}&user=`,
    `${base}&user=no%20body`,
    `${base}&user=${"u".repeat(MAX_EXEC_USER_CHARS + 1)}`,
    `${base}&user=-rf`,
  ];
  for (const q of hostile) {
    const got = await raw(q);
    if (got.status !== 400) throw new Error(`accepted: ${q.slice(0, 120)} -> ${JSON.stringify(got)}`);
    expect(got.code).toBe("bad_request");
  }
});

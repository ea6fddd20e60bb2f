/**
 * The gateway's end of a dial-out link against a hostile or mistaken caller (gateway/agents/
 * dial-hub.ts), on a real routing gateway (PGlite) over a real WebSocket: no token, a heartbeat's
 * token, a token of an agent enrolled at a URL (not to dial), a nonce of the wrong size are each
 * refused before the upgrade; a linked agent that sends a message it did not seal, or text, loses
 * the link (1008) and the gateway leaves it out of its live agents.
 */
import { afterEach, expect, test } from "bun:test";
import { mkdir, mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import WebSocket from "ws";
import { enroll } from "../../agent/api/enroll.ts";
import { DIAL_NONCE_HEADER, DIAL_PATH, DIAL_URL_SCHEME } from "../../contracts/agent/dial.ts";
import { dialNonce } from "../../contracts/agent/dial-cipher.ts";
import { secretKey, signHeartbeatToken } from "../../contracts/agent/token.ts";
import { createEnrollmentToken } from "../../gateway/agents/enrollment.ts";
import { startRoutingGateway } from "../support/agents.ts";

const SECRET = "dial-link-test-agent-secret-0123456789abcdef";
/** A migrating PGlite and two enrollments on a loaded host. */
const TEST_TIMEOUT_MS = 60_000;
const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

/** Opens the dial path: the refusal's status, or the open socket and the gateway's first message. */
function dial(
  url: string,
  headers: Record<string, string>,
): Promise<{ status: number } | { ws: WebSocket; greeting: Buffer }> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${url.replace(/^http/, "ws")}${DIAL_PATH}`, {
      headers,
      perMessageDeflate: false,
    });
    ws.once("unexpected-response", (_q, res) => {
      resolve({ status: res.statusCode ?? 0 });
      ws.terminate();
    });
    ws.once("message", (d: Buffer) => resolve({ ws, greeting: d }));
    ws.once("error", reject);
  });
}

const closed = (ws: WebSocket) => new Promise<number>((r) => ws.once("close", (code) => r(code)));

test(
  "refused before the upgrade unless a dial-out agent's own dial token; a linked agent that breaks the protocol loses its link",
  async () => {
    const gw = await startRoutingGateway({
      agentSecret: SECRET,
      staleAfterMs: 15_000,
      onCleanup: (c) => cleanups.push(c),
    });
    const stateDir = await mkdtemp(join(tmpdir(), "sbx-dial-link-"));
    cleanups.push(() => rm(stateDir, { recursive: true, force: true }));
    const credsOf = async (id: string, url?: string) => {
      const { token } = await gw.withDb((db) =>
        createEnrollmentToken(db, SECRET, { region: "eu", ...(url ? { url } : {}) }),
      );
      await mkdir(join(stateDir, id));
      return enroll({ gatewayUrl: gw.url, token, id, stateDir: join(stateDir, id) });
    };
    const dialer = await credsOf("byoc", DIAL_URL_SCHEME);
    const direct = await credsOf("direct", "http://10.0.0.9:7070");
    const nonce = Buffer.from(dialNonce()).toString("hex");
    const tokenOf = (c: typeof dialer, purpose: "dial" | "report" = "dial") =>
      signHeartbeatToken(secretKey(c.key), c.id, purpose);

    expect(await dial(gw.url, { [DIAL_NONCE_HEADER]: nonce })).toEqual({ status: 401 });
    expect(
      await dial(gw.url, {
        authorization: `Bearer ${await tokenOf(dialer, "report")}`,
        [DIAL_NONCE_HEADER]: nonce,
      }),
    ).toEqual({ status: 401 });
    expect(
      await dial(gw.url, { authorization: `Bearer ${await tokenOf(direct)}`, [DIAL_NONCE_HEADER]: nonce }),
    ).toEqual({
      status: 403,
    });
    expect(
      await dial(gw.url, { authorization: `Bearer ${await tokenOf(dialer)}`, [DIAL_NONCE_HEADER]: "abcd" }),
    ).toEqual({
      status: 400,
    });

    // The real handshake: the gateway's nonce, then a message that is not sealed with the key.
    const ok = await dial(gw.url, {
      authorization: `Bearer ${await tokenOf(dialer)}`,
      [DIAL_NONCE_HEADER]: nonce,
    });
    if (!("ws" in ok)) throw new Error(`refused: ${ok.status}`);
    expect(ok.greeting.length).toBe(16);
    const c1 = closed(ok.ws);
    ok.ws.send(Buffer.from("not sealed by anyone holding the key"));
    expect(await c1).toBe(1008);

    const again = await dial(gw.url, {
      authorization: `Bearer ${await tokenOf(dialer)}`,
      [DIAL_NONCE_HEADER]: nonce,
    });
    if (!("ws" in again)) throw new Error(`refused: ${again.status}`);
    const c2 = closed(again.ws);
    again.ws.send("text");
    expect(await c2).toBe(1008);
  },
  TEST_TIMEOUT_MS,
);

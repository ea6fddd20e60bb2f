/**
 * Terminals end to end over real HTTP (`bin/sandboxd up`, real VMs under TCG, a busybox image
 * whose shell is /bin/sh): a WebSocket client on `GET /v1/sandboxes/{id}/pty` types
 * `echo $((6*7))` and reads `42` (typed as binary and as text messages, as xterm.js sends them);
 * a resize message changes what `stty size` prints; an open terminal keeps its sandbox from being
 * suspended for idleness, and one suspended for idleness wakes for a terminal; closing the
 * WebSocket kills the shell and a
 * background job it started in its own process group (a later exec finds neither); the shell's
 * `exit` closes the WebSocket with 1000; a sessions API session has the same terminal; a foreign
 * tenant's id is 404 and a missing key 401, both before the upgrade. Prints the keystroke round
 * trip (one character typed, until its echo comes back; p50 over 30).
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import WebSocket from "ws";
import * as B from "../../contracts/api/sandboxes-api.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import { expectOk, latencySummary, uploadTemplate, waitFor } from "../support/e2e-service.ts";
import { useService } from "../support/service.ts";

/** A test boots a VM or two (~0.2-1 s each under TCG) and types a few lines. */
const TEST_TIMEOUT_MS = 180_000;
/** One template build (import, boot, snapshot: ~10-60 s under TCG) once `up` runs. */
const SETUP_TIMEOUT_MS = 240_000;
/** A template build: the image import, one boot and the snapshot; generous for a loaded host. */
const BUILD_TIMEOUT_MS = 180_000;
/** A harness wait for terminal output: a shell answering on a loaded, emulated guest. */
const OUTPUT_WAIT_MS = 20_000;
const TEMPLATE = "pty";
/** The reaper's interval, s: short so that an idle lifetime acts within the test's wait. */
const REAPER_INTERVAL_S = 1;
/** A short idle lifetime (suspend) for the wake-up test, s. */
const IDLE_S = 3;
const ESC = String.fromCharCode(0x1b);

let imgDir = "";
const liveSandboxes = new Set<string>();
const liveSessions = new Set<string>();

afterAll(async () => {
  if (imgDir) await rm(imgDir, { recursive: true, force: true });
});

const fx = useService({
  prefix: "sbx-e2e-pty-",
  python: false,
  keys: {
    live: ["acme", "live"],
    scale: ["acme", "scale"],
    pro: ["acme", "pro"],
    other: ["evil", "pro"],
  },
  env: { SANDBOXD_REAPER_INTERVAL: String(REAPER_INTERVAL_S) },
});

// Before the fixture stops `up`: what the tests made goes while `up` still runs.
fx.beforeStop(async () => {
  if (!keys) return;
  for (const id of liveSessions)
    await fx.api.delete(`/v1/sessions/${id}`, { key: keys.live, query: { force: "true" } }).catch(() => {});
  for (const id of liveSandboxes)
    await fx.api.delete(`/v1/sandboxes/${id}`, { key: keys.pro }).catch(() => {});
  await fx.api.delete(`/v1/templates/${TEMPLATE}`, { key: keys.scale });
});

let keys: Record<"live" | "scale" | "pro" | "other", string>;
const service = () => fx.svc;
const api = () => service().api;

beforeAll(async () => {
  keys = fx.keys;
  imgDir = await mkdtemp(join(tmpdir(), "sbx-pty-img-"));
  const archive = await makeDockerArchive(join(imgDir, "busybox.tar"), await busyboxImageSpec(imgDir));
  await uploadTemplate(
    service(),
    keys.scale,
    TEMPLATE,
    new Uint8Array(await readFile(archive.path)),
    BUILD_TIMEOUT_MS,
  );
}, SETUP_TIMEOUT_MS);

async function createSandbox(extra: Record<string, unknown> = {}): Promise<string> {
  const res = await api().post("/v1/sandboxes", { key: keys.pro, json: { template: TEMPLATE, ...extra } });
  const id = expectOk(res, 201, B.CreateSandboxResponse).id;
  liveSandboxes.add(id);
  return id;
}

async function exec(id: string, command: string): Promise<string> {
  const res = await api().post(`/v1/sandboxes/${id}/exec`, { key: keys.pro, json: { command } });
  return expectOk(res, 200, B.ExecResponseB).stdout;
}

/** A terminal client: everything the guest wrote so far, and waits on it. */
class Term {
  out = "";
  textMessages = 0;
  private waiters: Array<() => void> = [];
  readonly closed: Promise<{ code: number; reason: string }>;

  constructor(readonly ws: WebSocket) {
    ws.on("message", (data: Buffer, isBinary: boolean) => {
      if (!isBinary) this.textMessages++; // terminal output always comes as binary messages
      this.out += data.toString("utf8");
      for (const w of this.waiters.splice(0)) w();
    });
    this.closed = new Promise((resolve) =>
      ws.once("close", (code, reason) => {
        resolve({ code, reason: reason.toString() });
        for (const w of this.waiters.splice(0)) w();
      }),
    );
  }

  /** Types `text` as one binary message (or a text message, as xterm.js's attach addon does). */
  type(text: string, asText = false): void {
    this.ws.send(asText ? text : Buffer.from(text), { binary: !asText });
  }

  /** Resolves once the output from `from` on matches `re`; the match. */
  async wait(re: RegExp, from = 0, ms = OUTPUT_WAIT_MS): Promise<RegExpMatchArray> {
    const deadline = performance.now() + ms;
    for (;;) {
      const m = this.out.slice(from).match(re);
      if (m) return m;
      if (performance.now() > deadline || this.ws.readyState !== WebSocket.OPEN) {
        throw new Error(`no ${re} in the terminal output: ${JSON.stringify(this.out.slice(from))}`);
      }
      await new Promise<void>((resolve) => {
        this.waiters.push(resolve);
        setTimeout(resolve, 50);
      });
    }
  }

  /** Types a command line and waits for a marker only its output can contain. */
  async run(line: string, expected: RegExp): Promise<RegExpMatchArray> {
    const from = this.out.length;
    this.type(`${line}\r`);
    return this.wait(expected, from);
  }
}

type Opened = { term: Term } | { status: number; body: string };

function openPty(path: string, key: string | undefined): Promise<Opened> {
  const url = `${service().url.replace(/^http/, "ws")}${path}`;
  const headers: Record<string, string> = key ? { authorization: `Bearer ${key}` } : {};
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(url, { headers, perMessageDeflate: false });
    ws.once("open", () => resolve({ term: new Term(ws) }));
    ws.once("unexpected-response", (_req, res) => {
      let body = "";
      res.on("data", (b: Buffer) => {
        body += b.toString();
      });
      res.on("end", () => resolve({ status: res.statusCode ?? 0, body }));
    });
    ws.once("error", reject);
  });
}

async function mustOpen(path: string, key: string): Promise<Term> {
  const o = await openPty(path, key);
  if (!("term" in o)) throw new Error(`pty refused: ${o.status} ${o.body}`);
  // The shell is up once it printed its prompt (busybox sh: `/app # `, then its cursor-position query).
  await o.term.wait(new RegExp(`[#$] (${ESC}\\[6n)?$`));
  return o.term;
}

describe("terminal (GET .../pty)", () => {
  test(
    "a client types echo $((6*7)) and reads 42; text messages are typed input too; resize reaches stty",
    async () => {
      const id = await createSandbox();
      const term = await mustOpen(`/v1/sandboxes/${id}/pty?cols=80&rows=24`, keys.pro);
      // `42` on a line of its own: the typed line itself (echoed back) holds `$((6*7))`, not 42.
      await term.run("echo $((6*7))", /\r\n42\r\n/);
      let from = term.out.length;
      term.type("echo text$((40+2))\r", true);
      await term.wait(/\r\ntext42\r\n/, from);
      // A login-like environment: TERM, HOME and USER from the image's passwd entry.
      await term.run('echo "t=$TERM h=$HOME u=$USER"', /\r\nt=xterm-256color h=\/root u=root\r\n/);
      await term.run("stty size", /\r\n24 80\r\n/);
      term.type(JSON.stringify({ type: "resize", cols: 123, rows: 45 }), true);
      await term.run("stty size", /\r\n45 123\r\n/);

      // Keystroke round trip: one character typed until its echo is back, then erased (^U).
      const samples: number[] = [];
      const typedFrom = term.out.length;
      for (let i = 0; i < 30; i++) {
        from = term.out.length;
        const t0 = performance.now();
        term.type("x");
        await term.wait(/x/, from);
        samples.push(performance.now() - t0);
      }
      // Each sample an echo of what was typed: 30 of them, every x shown.
      expect(samples).toHaveLength(30);
      expect(term.out.slice(typedFrom).split("x").length - 1).toBeGreaterThanOrEqual(30);
      from = term.out.length;
      term.type("\x15echo done\r");
      await term.wait(/\r\ndone\r\n/, from);
      console.log(`terminal keystroke round trip: ${JSON.stringify(latencySummary(samples))}`);

      // The shell's own exit ends the WebSocket cleanly.
      term.type("exit\r");
      expect((await term.closed).code).toBe(1000);
      expect(term.textMessages).toBe(0);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "with lines=true a text message is a typed line and Enter is added (wscat sends lines without one)",
    async () => {
      const id = await createSandbox();
      const term = await mustOpen(`/v1/sandboxes/${id}/pty?lines=true`, keys.pro);
      const from = term.out.length;
      term.type("echo $((6*7))", true);
      // Run without an Enter typed: its answer on a line of its own.
      expect((await term.wait(/\r\n42\r\n/, from))[0]).toBe("\r\n42\r\n");
      term.ws.close(1000);
      await term.closed;
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "closing the WebSocket kills the shell and the job it left in the background",
    async () => {
      const id = await createSandbox();
      const term = await mustOpen(`/v1/sandboxes/${id}/pty`, keys.pro);
      // A job-control shell puts the job in its own process group: killing the shell's group
      // alone would leave it.
      await term.run("sleep 4242 & echo started-$((1+1))", /started-2/);
      const ps = () => exec(id, "ps -o pid,args");
      const shellLeft = (s: string) => s.split("\n").filter((l) => /sleep 4242|-sh$/.test(l.trim()));
      // The check sees both while the terminal is open (so it can fail).
      expect(shellLeft(await ps()).length).toBe(2);
      term.ws.close(1000);
      await term.closed;
      let left: string[] = [];
      const gone = await waitFor(async () => {
        left = shellLeft(await ps());
        return left.length === 0;
      }, 20_000);
      expect({ gone, left }).toEqual({ gone: true, left: [] });
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "an open terminal keeps its sandbox from idling; a sandbox suspended for idleness wakes for one",
    async () => {
      const id = await createSandbox({ idle_timeout_seconds: IDLE_S, idle_action: "suspend" });
      const state = async () =>
        expectOk(await api().get(`/v1/sandboxes/${id}`, { key: keys.pro }), 200, B.SandboxInfo).state;
      let term = await mustOpen(`/v1/sandboxes/${id}/pty`, keys.pro);
      // Twice the lifetime with the terminal open and nothing typed: still running, still answering.
      await Bun.sleep(2 * IDLE_S * 1000 + 2 * REAPER_INTERVAL_S * 1000);
      expect(await state()).toBe("running");
      await term.run("echo $((6*7))", /\r\n42\r\n/);
      term.ws.close(1000);
      await term.closed;
      // Closed: the lifetime applies again (so the check above could have failed).
      expect(await waitFor(async () => (await state()) === "suspended", 20_000)).toBe(true);
      term = await mustOpen(`/v1/sandboxes/${id}/pty`, keys.pro);
      await term.run("echo $((6*7))", /\r\n42\r\n/);
      expect(await state()).toBe("running");
      term.ws.close(1000);
      await term.closed;
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a sessions API session has a terminal too",
    async () => {
      const res = await api().post("/v1/sessions", { key: keys.live, json: { template_id: TEMPLATE } });
      const id = expectOk(res, 201, A.CreateSessionResponse).session_id;
      liveSessions.add(id);
      const term = await mustOpen(`/v1/sessions/${id}/pty?cols=100&rows=30`, keys.live);
      await term.run("echo $((6*7)); stty size", /\r\n42\r\n30 100\r\n/);
      term.ws.close(1000);
      await term.closed;
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a foreign tenant's id is 404 and no key 401, before the upgrade; a plain GET is 400",
    async () => {
      const id = await createSandbox();
      const foreign = await openPty(`/v1/sandboxes/${id}/pty`, keys.other);
      expect("status" in foreign && { status: foreign.status, code: JSON.parse(foreign.body).code }).toEqual({
        status: 404,
        code: "not_found",
      });
      const anonymous = await openPty(`/v1/sandboxes/${id}/pty`, undefined);
      expect("status" in anonymous && anonymous.status).toBe(401);
      const bad = await openPty(`/v1/sandboxes/${id}/pty?cols=0`, keys.pro);
      expect("status" in bad && bad.status).toBe(400);
      const plain = await api().get(`/v1/sandboxes/${id}/pty`, { key: keys.pro });
      expect(plain.status).toBe(400);
    },
    TEST_TIMEOUT_MS,
  );
});

/**
 * E2B's data plane end to end (docs/e2b.md "Data plane", "Processes"): `bin/sandboxd up` with the
 * catalog's python template (Debian with /bin/bash, root), a sandbox made through /v1, its envd
 * access token signed as the control plane signs it, and E2B's SDK (`e2b`, unmodified) driving
 * `/e2b/envd`: commands with streamed output and exit codes, env/cwd/user, background processes
 * with connect/list/kill, stdin, terminals (with envs, cwd and user); the raw Connect client for SIGTERM and hostile bodies;
 * tokens of other tenants, forged and revoked refused; host routing; a guest HTTP port.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createConnectTransport } from "@connectrpc/connect-web";
import { CommandExitError, Sandbox } from "e2b";
import { MAX_PTY_ENV_BYTES } from "../../contracts/agent/pty.ts";
import { parseApiKey } from "../../contracts/api/api-key.ts";
import { Filesystem } from "../../contracts/e2b/envd/filesystem_pb.ts";
import { Process, Signal } from "../../contracts/e2b/envd/process_pb.ts";
import { E2B_ENVD_VERSION, e2bKeyOf, e2bSandboxId } from "../../contracts/e2b/ids.ts";
import { openDb } from "../../db/client.ts";
import { ensureTenant, type Principal } from "../../gateway/auth/keys.ts";
import { loadSecrets } from "../../gateway/auth/secrets.ts";
import { PTY_PID_BASE } from "../../gateway/e2b/envd/process.ts";
import { signEnvdToken } from "../../gateway/e2b/envd-token.ts";
import {
  createKeys,
  prepareDataDir,
  type RunningService,
  runCli,
  startUp,
  stopAndClean,
  waitForTemplate,
} from "../support/e2e-service.ts";

/** The python template's first build under TCG, plus `up`'s start. */
/** The guest's HTTP server on port 8000 for the guest-port test (python3 of the template). */
const GUEST_SERVER = `import http.server
class H(http.server.SimpleHTTPRequestHandler):
    def do_POST(self):
        n = 0
        while True:
            size = int(self.rfile.readline().strip(), 16)
            if size == 0:
                self.rfile.readline()
                break
            n += len(self.rfile.read(size))
            self.rfile.readline()
        body = str(n).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("", 8000), H).serve_forever()
`;

const SETUP_TIMEOUT_MS = 600_000;
/** A test runs a handful of guest commands under TCG. */
const TEST_TIMEOUT_MS = 120_000;
const DOMAIN = "e2b.test";

let svc: RunningService | undefined;
let dataDir = "";
let tenantId = "";
/** The gateway's connect secret (its file in the data dir), which signs envd tokens. */
let SECRET = "";
let keys: Record<"pro" | "other" | "doomed", string>;
let sandboxId = "";
let token = "";
let sbx: Sandbox;

const principalOf = (key: string, tenant: string): Principal => ({
  tenantId: tenant,
  keyId: parseApiKey(key)!.keyId,
  tier: "pro",
  api: "sandboxes",
});

/** The SDK's Sandbox object on our data plane, as the control plane's answer would build it. */
function sdkSandbox(accessToken: string): Sandbox {
  const S = Sandbox as unknown as new (o: Record<string, unknown>) => Sandbox;
  return new S({
    sandboxId: e2bSandboxId(sandboxId),
    envdVersion: E2B_ENVD_VERSION,
    envdAccessToken: accessToken,
    apiKey: e2bKeyOf(keys.pro),
    apiUrl: `${svc!.url}/e2b`,
    sandboxUrl: `${svc!.url}/e2b/envd`,
  });
}

/** The raw Connect client with E2B's headers (what the SDK's transport sends). */
function rawClient(headers: Record<string, string>) {
  return rawClientOf(Process, headers);
}

function rawClientOf<S extends typeof Process | typeof Filesystem>(
  service: S,
  headers: Record<string, string>,
) {
  return createClient(
    service,
    createConnectTransport({
      baseUrl: `${svc!.url}/e2b/envd`,
      useBinaryFormat: false,
      fetch: ((url: string, init?: RequestInit) => {
        const h = new Headers(init?.headers);
        for (const [k, v] of Object.entries(headers)) h.set(k, v);
        return fetch(url, { ...init, headers: h });
      }) as typeof fetch,
    }),
  );
}
const envdHeaders = (tok = token) => ({
  "E2b-Sandbox-Id": e2bSandboxId(sandboxId),
  "E2b-Sandbox-Port": "49983",
  "X-Access-Token": tok,
});

beforeAll(async () => {
  dataDir = await prepareDataDir("sbx-e2e-e2bp-");
  const h = await openDb({ dataDir });
  try {
    tenantId = await ensureTenant(h.db, "acme");
  } finally {
    await h.close();
  }
  keys = await createKeys(dataDir, { pro: ["acme", "pro"], other: ["evil", "pro"], doomed: ["acme", "pro"] });
  svc = await startUp(dataDir, [], { SANDBOXD_E2B_DOMAIN: DOMAIN });
  SECRET = loadSecrets(dataDir).connectSecret;
  await waitForTemplate(svc, "python", SETUP_TIMEOUT_MS - 120_000);
  const created = await svc.api.post<{ id: string }>("/v1/sandboxes", {
    json: { template: "python" },
    key: keys.pro,
  });
  expect(created.status).toBe(201);
  sandboxId = created.body!.id;
  token = await signEnvdToken(
    SECRET,
    principalOf(keys.pro, tenantId),
    sandboxId,
    Math.floor(Date.now() / 1000),
  );
  sbx = sdkSandbox(token);
}, SETUP_TIMEOUT_MS);

afterAll(async () => {
  if (svc && sandboxId) await svc.api.delete(`/v1/sandboxes/${sandboxId}`, { key: keys.pro }).catch(() => {});
  await stopAndClean(svc, dataDir);
}, 120_000);

describe("E2B envd: processes", () => {
  test(
    "run: streamed stdout/stderr, exit codes, env, cwd, user",
    async () => {
      const seen: string[] = [];
      const ok = await sbx.commands.run("echo out; echo err >&2; echo $A; pwd; id -un", {
        envs: { A: "from-env" },
        cwd: "/tmp",
        user: "root",
        onStdout: (d) => {
          seen.push(d);
        },
      });
      expect(ok.exitCode).toBe(0);
      expect(ok.stdout).toBe("out\nfrom-env\n/tmp\nroot\n");
      expect(ok.stderr).toBe("err\n");
      expect(seen.join("")).toBe(ok.stdout);
      const failed = await sbx.commands.run("echo bye; exit 3").catch((e: unknown) => e);
      expect(failed).toBeInstanceOf(CommandExitError);
      expect((failed as CommandExitError).exitCode).toBe(3);
      expect((failed as CommandExitError).stdout).toBe("bye\n");
      // stdin defaults to closed: cat reads end of file at once.
      expect((await sbx.commands.run("cat; echo done")).stdout).toBe("done\n");
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "background, list, connect by pid, kill (SIGKILL) and SIGTERM",
    async () => {
      const bg = await sbx.commands.run("sleep 60", { background: true });
      const listed = await sbx.commands.list();
      const mine = listed.find((p) => p.pid === bg.pid);
      expect(mine?.cmd).toBe("/bin/bash");
      expect(mine?.args).toEqual(["-l", "-c", "sleep 60"]);
      const again = await sbx.commands.connect(bg.pid);
      expect(again.pid).toBe(bg.pid);
      expect(await sbx.commands.kill(bg.pid)).toBe(true);
      const ended = await bg.wait().catch((e: unknown) => e);
      expect(ended).toBeInstanceOf(CommandExitError);
      expect(await sbx.commands.kill(bg.pid)).toBe(false);
      expect(await sbx.commands.kill(999_999)).toBe(false);

      const term = await sbx.commands.run("echo up; sleep 60", { background: true });
      const until = Date.now() + 30_000;
      while (term.stdout === "" && Date.now() < until) await Bun.sleep(50);
      await rawClient(envdHeaders()).sendSignal({
        process: { selector: { case: "pid", value: term.pid } },
        signal: Signal.SIGTERM,
      });
      const e2 = await term.wait().catch((e: unknown) => e);
      expect(e2).toBeInstanceOf(CommandExitError);
      expect(term.stdout).toBe("up\n");
      expect((await sbx.commands.list()).some((p) => p.pid === term.pid)).toBe(false);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a stream past its Connect-Timeout-Ms ends with deadline_exceeded, and its process runs on",
    async () => {
      // The header alone, no deadline of the client's own: the server's deadline is what ends it.
      const client = rawClient({ ...envdHeaders(), "Connect-Timeout-Ms": "1500" });
      let pid = 0;
      const t0 = Date.now();
      const ended = await (async () => {
        for await (const r of client.start({ process: { cmd: "/bin/sleep", args: ["30"], envs: {} } })) {
          const e = r.event?.event;
          if (e?.case === "start") pid = e.value.pid;
        }
      })().then(
        () => "ended without an error",
        (e: unknown) => e,
      );
      expect(ended).toBeInstanceOf(ConnectError);
      expect((ended as ConnectError).code).toBe(Code.DeadlineExceeded);
      expect(Date.now() - t0).toBeLessThan(20_000);
      expect(pid).toBeGreaterThan(0);
      expect((await sbx.commands.list()).some((p) => p.pid === pid)).toBe(true);
      expect(await sbx.commands.kill(pid)).toBe(true);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a directory watch past its Connect-Timeout-Ms ends with deadline_exceeded, after its start event",
    async () => {
      const client = rawClientOf(Filesystem, { ...envdHeaders(), "Connect-Timeout-Ms": "1500" });
      const events: string[] = [];
      const t0 = Date.now();
      const ended = await (async () => {
        for await (const r of client.watchDir({ path: "/tmp", recursive: false })) {
          events.push(r.event.case ?? "none");
        }
      })().then(
        () => "ended without an error",
        (e: unknown) => e,
      );
      expect(ended).toBeInstanceOf(ConnectError);
      expect((ended as ConnectError).code).toBe(Code.DeadlineExceeded);
      expect(events[0]).toBe("start");
      expect(Date.now() - t0).toBeLessThan(20_000);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "pids are the guest's: kill -0 finds a background process, not once it was killed; list and connect by it",
    async () => {
      const bg = await sbx.commands.run("sleep 30", { background: true });
      // Not the agent's numbers (1, 2, ...): PID 1 is the guest agent itself.
      expect(bg.pid).toBeGreaterThan(1);
      expect((await sbx.commands.run(`kill -0 ${bg.pid} && echo alive`)).stdout).toBe("alive\n");
      // `sleep 30` under bash -c: the pid is the command's, its /proc entry names sleep or bash.
      const comm = (await sbx.commands.run(`cat /proc/${bg.pid}/comm`)).stdout.trim();
      expect(["sleep", "bash"]).toContain(comm);
      expect((await sbx.commands.list()).some((p) => p.pid === bg.pid)).toBe(true);
      const again = await sbx.commands.connect(bg.pid);
      expect(again.pid).toBe(bg.pid);
      expect(await sbx.commands.kill(bg.pid)).toBe(true);
      await bg.wait().catch(() => {});
      const gone = await sbx.commands.run(`kill -0 ${bg.pid} 2>/dev/null; echo $?`);
      expect(gone.stdout).toBe("1\n");
      expect((await sbx.commands.list()).some((p) => p.pid === bg.pid)).toBe(false);
      expect(await sbx.commands.kill(bg.pid)).toBe(false);
      expect(await sbx.commands.kill(999_999)).toBe(false);
      const missing = await sbx.commands.connect(999_999).catch((e: unknown) => e);
      expect((missing as Error).name).toBe("NotFoundError");
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "stdin, then close stdin",
    async () => {
      const cat = await sbx.commands.run("cat", { background: true, stdin: true });
      await sbx.commands.sendStdin(cat.pid, "hello ");
      await cat.sendStdin(new TextEncoder().encode("world"));
      await cat.closeStdin();
      const r = await cat.wait();
      expect(r.stdout).toBe("hello world");
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a terminal: output, input, resize, kill",
    async () => {
      let out = "";
      const dec = new TextDecoder();
      const term = await sbx.pty.create({
        cols: 80,
        rows: 24,
        onData: (d) => {
          out += dec.decode(d);
        },
      });
      await sbx.pty.resize(term.pid, { cols: 100, rows: 40 });
      await sbx.pty.sendInput(term.pid, new TextEncoder().encode("echo $((6*7)); stty size\n"));
      const deadline = Date.now() + 30_000;
      while (!(out.includes("42") && out.includes("40 100")) && Date.now() < deadline) await Bun.sleep(100);
      expect(out).toContain("42");
      expect(out).toContain("40 100");
      // The terminal's pid is its shell's in the guest.
      await sbx.pty.sendInput(term.pid, new TextEncoder().encode("echo pid=$$\n"));
      const until = Date.now() + 30_000;
      while (!out.includes(`pid=${term.pid}\r\n`) && Date.now() < until) await Bun.sleep(100);
      expect(out).toContain(`pid=${term.pid}\r\n`);
      expect(term.pid).toBeLessThan(1 << 22);
      expect((await sbx.commands.list()).some((p) => p.pid === term.pid)).toBe(true);
      expect(await sbx.pty.kill(term.pid)).toBe(true);
      await term.wait().catch(() => {});
      expect(await sbx.pty.kill(term.pid)).toBe(false);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a terminal with envs, cwd and user; an unknown user and an env past the bound refused",
    async () => {
      const dec = new TextDecoder();
      /** Opens a terminal, types `line`, and answers its output once `until` shows in it. */
      const session = async (
        opts: { envs?: Record<string, string>; cwd?: string; user?: string },
        until: RegExp,
      ) => {
        let out = "";
        const term = await sbx.pty.create({
          cols: 80,
          rows: 24,
          ...opts,
          onData: (d) => {
            out += dec.decode(d);
          },
        });
        // The typed line is echoed as typed ($ABC, $(pwd)): only the output lines match `until`.
        await sbx.pty.sendInput(
          term.pid,
          new TextEncoder().encode('echo "A=$ABC P=$(pwd) U=$(id -u) L=$LANG"\n'),
        );
        const deadline = Date.now() + 30_000;
        while (!until.test(out) && Date.now() < deadline) await Bun.sleep(100);
        expect(await sbx.pty.kill(term.pid)).toBe(true);
        await term.wait().catch(() => {});
        return out;
      };
      // E2B's SDK sends `/bin/bash -i -l` with TERM, LANG and LC_ALL: LANG shows the envs arrive.
      const mine = await session({ envs: { ABC: "123" }, cwd: "/tmp", user: "root" }, /A=123 P=\/tmp U=0 /);
      expect(mine).toMatch(/A=123 P=\/tmp U=0 L=C\.UTF-8/);
      const nobody = await session({ cwd: "/", user: "nobody" }, /U=65534 /);
      expect(nobody).toMatch(/A= P=\/ U=65534 /);

      const unknown = await sbx.pty
        .create({ cols: 80, rows: 24, user: "no-such-user", onData: () => {} })
        .catch((e: unknown) => e);
      expect(unknown).toBeInstanceOf(Error);
      expect(String(unknown)).toContain("no-such-user");
      const big = await sbx.pty
        .create({ cols: 80, rows: 24, envs: { BIG: "x".repeat(MAX_PTY_ENV_BYTES) }, onData: () => {} })
        .catch((e: unknown) => e);
      expect(big).toBeInstanceOf(Error);
      expect(String(big)).toContain("env");
      // Neither left a terminal behind.
      expect((await sbx.commands.list()).filter((p) => p.pid >= PTY_PID_BASE)).toEqual([]);
    },
    TEST_TIMEOUT_MS,
  );
});

describe("E2B envd: authentication and routing", () => {
  test(
    "tokens of another tenant, forged and of a revoked key are refused; a key works instead",
    async () => {
      const foreign = await signEnvdToken(SECRET, principalOf(keys.other, "ten_other"), sandboxId, 0);
      const r1 = await sdkSandbox(foreign)
        .commands.list()
        .catch((e: unknown) => e);
      expect((r1 as Error).name).toBe("TimeoutError"); // 502: E2B's "sandbox not found" answer
      const forged = await signEnvdToken(
        "another-secret-of-sufficient-length",
        principalOf(keys.pro, tenantId),
        sandboxId,
        0,
      );
      const r2 = await sdkSandbox(forged)
        .commands.list()
        .catch((e: unknown) => e);
      expect((r2 as Error).name).toBe("AuthenticationError");
      const doomed = await signEnvdToken(SECRET, principalOf(keys.doomed, tenantId), sandboxId, 0);
      expect(Array.isArray(await sdkSandbox(doomed).commands.list())).toBe(true);
      const rev = await runCli(["key", "revoke", parseApiKey(keys.doomed)!.keyId, "--data-dir", dataDir]);
      expect(rev.code).toBe(0);
      await Bun.sleep(1500); // past the liveness cache (1 s)
      const r3 = await sdkSandbox(doomed)
        .commands.list()
        .catch((e: unknown) => e);
      expect((r3 as Error).name).toBe("AuthenticationError");
      // An API key instead of the token; another tenant's key sees no such sandbox.
      const byKey = await fetch(`${svc!.url}/e2b/envd/health`, {
        headers: { "E2b-Sandbox-Id": e2bSandboxId(sandboxId), "X-API-KEY": e2bKeyOf(keys.pro) },
      });
      expect(byKey.status).toBe(204);
      const foreignKey = await fetch(`${svc!.url}/e2b/envd/health`, {
        headers: { "E2b-Sandbox-Id": e2bSandboxId(sandboxId), Authorization: `Bearer ${keys.other}` },
      });
      expect(foreignKey.status).toBe(502);
      expect(((await foreignKey.json()) as { message: string }).message).toContain("not found");
      const none = await fetch(`${svc!.url}/e2b/envd/health`, { headers: { "E2b-Sandbox-Id": "nosuch" } });
      expect(none.status).toBe(401);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "host routing: <port>-<id>.<domain> reaches envd, and a guest HTTP port",
    async () => {
      const host = `49983-${e2bSandboxId(sandboxId)}.${DOMAIN}`;
      const health = await fetch(`${svc!.url}/health`, { headers: { Host: host, "X-Access-Token": token } });
      expect(health.status).toBe(204);
      const other = await fetch(`${svc!.url}/health`, {
        headers: { Host: `49983-${e2bSandboxId(sandboxId)}.elsewhere.test` },
      });
      expect(other.status).toBe(404);
      // Files from /srv, and a POST answered with the size of its (chunked) body once read whole:
      // a server that answers before reading a body races its own close against the answer.
      await sbx.files.write("/srv/serve.py", GUEST_SERVER);
      const server = await sbx.commands.run(
        "echo served > /srv/hi.txt && cd /srv && exec python3 /srv/serve.py",
        {
          background: true,
        },
      );
      const guestHost = `8000-${e2bSandboxId(sandboxId)}.${DOMAIN}`;
      let res: Response | undefined;
      const deadline = Date.now() + 60_000;
      while (Date.now() < deadline) {
        res = await fetch(`${svc!.url}/hi.txt`, { headers: { Host: guestHost, "X-Access-Token": token } });
        if (res.status !== 502) break;
        await Bun.sleep(500);
      }
      expect(res?.status).toBe(200);
      expect(await res!.text()).toBe("served\n");
      const posted = await fetch(`${svc!.url}/upload`, {
        method: "POST",
        body: "x".repeat(100_000),
        headers: { Host: guestHost, "X-Access-Token": token },
      });
      expect(posted.status).toBe(200);
      expect(await posted.text()).toBe("100000");
      await server.kill();
      const closed = await fetch(`${svc!.url}/hi.txt`, {
        headers: { Host: `8001-${e2bSandboxId(sandboxId)}.${DOMAIN}`, "X-Access-Token": token },
      });
      expect(closed.status).toBe(502);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "hostile input: unknown procedures, malformed and huge bodies",
    async () => {
      const post = (path: string, body: string | Uint8Array, type = "application/json") =>
        fetch(`${svc!.url}/e2b/envd${path}`, {
          method: "POST",
          body,
          headers: { ...envdHeaders(), "content-type": type },
        });
      const unknown = await post("/process.Process/Nope", "{}");
      expect(unknown.status).toBe(501);
      expect(((await unknown.json()) as { code: string }).code).toBe("unimplemented");
      const malformed = await post("/process.Process/List", "{not json");
      expect(malformed.status).toBe(400);
      await malformed.arrayBuffer();
      const huge = await post("/process.Process/SendInput", new Uint8Array(9 * 1024 * 1024).fill(0x20));
      expect(huge.status).toBeGreaterThanOrEqual(400);
      await huge.arrayBuffer();
      const badPid = await rawClient(envdHeaders())
        .sendInput({
          process: { selector: { case: "pid", value: 424242 } },
          input: { input: { case: "stdin", value: new Uint8Array([1]) } },
        })
        .catch((e: unknown) => e);
      expect(String(badPid)).toContain("not_found");
      // Still serving.
      expect(Array.isArray(await sbx.commands.list())).toBe(true);
    },
    TEST_TIMEOUT_MS,
  );
});

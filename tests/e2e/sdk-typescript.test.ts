/**
 * The TypeScript SDK (sdk/typescript) against the real service: `bin/sandboxd up` with its python
 * catalog template, real VMs. Its README quickstart (extracted from sdk/typescript/README.md, so
 * it cannot drift), its agent-loop example and its terminal example run as separate programs
 * under Bun, Node (the `node` on PATH, the built dist/index.js; skipped with a message when it is
 * older than 20 or absent) and Deno (the `deno` devDependency), the way a user runs them: a project directory whose node_modules holds
 * `@sandboxd/sdk`, the service and key given by SANDBOXD_URL / SANDBOXD_API_KEY. After each run
 * the tenant has no sandbox left (the programs delete what they made). Then, in this process, the
 * rest of the surface: processes, suspend/resume, files list/remove, errors as SandboxdError with
 * the service's code and status, sessions API one-shot exec and sessions, templates.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { mkdir, mkdtemp, readFile, rm, symlink, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { buildSdk } from "../../sdk/typescript/build.ts";
import { Sandboxd, SandboxdError } from "../../sdk/typescript/src/index.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import { REPO, runCommand, waitFor } from "../support/e2e-service.ts";
import { useService } from "../support/service.ts";

/** The SDK build and the user's project, once `up` runs. */
const SETUP_TIMEOUT_MS = 240_000;
/** One program: a few sandboxes created, forked and deleted under TCG on a shared host. */
const RUN_TIMEOUT_MS = 240_000;
const PYTHON = "python";
const SDK_DIR = join(REPO, "sdk/typescript");
const DENO = join(REPO, "node_modules/.bin/deno");

const RUNTIMES = {
  bun: (file: string) => [process.execPath, file],
  node: (file: string) => ["node", file],
  deno: (file: string) => [DENO, "run", "-A", "--quiet", file],
} as const;
type Runtime = keyof typeof RUNTIMES;
/**
 * The SDK supports Node >= 20 (global WebCrypto, fetch). Debian's own nodejs is older, so the
 * suite does not install one: without a Node >= 20 on PATH the Node runs are skipped, and say so.
 */
const NODE_MAJOR = Number(
  /^v(\d+)\./.exec(spawnSync("node", ["--version"], { encoding: "utf8" }).stdout ?? "")?.[1] ?? 0,
);
const runsUnder = (r: Runtime) => r !== "node" || NODE_MAJOR >= 20;
if (!runsUnder("node")) console.warn("sdk-typescript: no Node >= 20 on PATH, skipping the Node runs");

let projectDir = "";

afterAll(async () => {
  if (projectDir) await rm(projectDir, { recursive: true, force: true });
});

const fx = useService({
  prefix: "sbx-e2e-sdkts-",
  keys: {
    pro: ["acme", "pro"],
    live: ["acme", "live"],
    scale: ["acme", "scale"],
    other: ["evil", "pro"],
  },
});

// Before the fixture stops `up`: whatever a failed test left goes through the API while `up` runs.
fx.beforeStop(async () => {
  if (!keys) return;
  const c = new Sandboxd({ baseUrl: fx.svc.url, apiKey: keys.pro });
  for (const sbx of await c.sandboxes.list()) {
    await c.sandboxes
      .ref(sbx.id)
      .delete()
      .catch(() => {});
  }
});

let keys: Record<"pro" | "live" | "scale" | "other", string>;
const service = () => fx.svc;
const client = (key = keys.pro) => new Sandboxd({ baseUrl: service().url, apiKey: key });

/** The ```js block after `<!-- sdk-quickstart -->` in the SDK's README. */
function quickstartOf(readme: string): string {
  const m = /<!-- sdk-quickstart -->\n```js\n([\s\S]*?)\n```/.exec(readme);
  if (!m) throw new Error("sdk/typescript/README.md has no quickstart block after <!-- sdk-quickstart -->");
  return m[1]!;
}

/** An example's TypeScript as JavaScript (types stripped, imports kept) for Node 20 and Deno. */
async function exampleAsJs(name: string): Promise<string> {
  const ts = await readFile(join(SDK_DIR, "examples", name), "utf8");
  return new Bun.Transpiler({ loader: "ts", target: "node" }).transformSync(ts);
}

beforeAll(async () => {
  await buildSdk();
  // A user's project: `@sandboxd/sdk` in its node_modules (a link to the package in this repo).
  projectDir = await mkdtemp(join(tmpdir(), "sdk-ts-project-"));
  await mkdir(join(projectDir, "node_modules/@sandboxd"), { recursive: true });
  await symlink(SDK_DIR, join(projectDir, "node_modules/@sandboxd/sdk"));
  await writeFile(join(projectDir, "package.json"), JSON.stringify({ type: "module", private: true }));
  await writeFile(
    join(projectDir, "quickstart.mjs"),
    quickstartOf(await readFile(join(SDK_DIR, "README.md"), "utf8")),
  );
  await writeFile(join(projectDir, "agent-loop.mjs"), await exampleAsJs("agent-loop.ts"));
  await writeFile(join(projectDir, "terminal.mjs"), await exampleAsJs("terminal.ts"));

  keys = fx.keys;
}, SETUP_TIMEOUT_MS);

type RunResult = Awaited<ReturnType<typeof runCommand>>;

/** Runs a program of the project dir under `runtime` with the service's URL and a key. */
function runProgram(runtime: Runtime, file: string, key = keys.pro): Promise<RunResult> {
  const [cmd, ...args] = RUNTIMES[runtime](join(projectDir, file));
  return runCommand(cmd!, args, {
    cwd: projectDir,
    env: {
      PATH: process.env.PATH,
      HOME: process.env.HOME,
      SANDBOXD_URL: service().url,
      SANDBOXD_API_KEY: key,
      // Deno: no update check, no colour codes in what the test reads.
      DENO_NO_UPDATE_CHECK: "1",
      NO_COLOR: "1",
    },
    timeoutMs: RUN_TIMEOUT_MS - 10_000,
  });
}

function expectRan(r: RunResult, wanted: (string | RegExp)[]): void {
  const all = `exit ${r.code}\n--- stdout\n${r.stdout}\n--- stderr\n${r.stderr}`;
  if (r.code !== 0) throw new Error(`the program failed:\n${all}\n--- service\n${service().logTail(30)}`);
  for (const w of wanted) {
    if (typeof w === "string" ? !r.stdout.includes(w) : !w.test(r.stdout)) {
      throw new Error(`the output lacks ${String(w)}:\n${all}`);
    }
  }
}

async function expectNoSandboxes(): Promise<void> {
  expect(await client().sandboxes.list()).toEqual([]);
}

describe.each(Object.keys(RUNTIMES) as Runtime[])("under %s", (runtime) => {
  const run = runsUnder(runtime) ? test : test.skip;
  run(
    "the README quickstart runs as written",
    async () => {
      const r = await runProgram(runtime, "quickstart.mjs");
      expectRan(r, [
        "exec: hi (exit 0)",
        "line 0\nline 1\nline 2\nstream: exit 0",
        "stream: exit 0",
        "read back 52 characters",
        "fork sees: 2 lines",
      ]);
      await expectNoSandboxes();
    },
    RUN_TIMEOUT_MS,
  );

  run(
    "the agent-loop example: branches forked, the best kept, the rest deleted",
    async () => {
      const r = await runProgram(runtime, "agent-loop.mjs");
      expectRan(r, [
        /root sbx_\w+: Python 3\.\d+/,
        "[root] stdout: answer=8 expected=12 ok=False",
        "root attempt scored 0",
        "scores: 100, 100, 0; best: branch 1",
        "kept branch answers 12",
        "done",
      ]);
      await expectNoSandboxes();
    },
    RUN_TIMEOUT_MS,
  );

  run(
    "the terminal example types into a shell and reads 42",
    async () => {
      const r = await runProgram(runtime, "terminal.mjs");
      expectRan(r, ["terminal answered 42", "terminal closed (1000)"]);
      await expectNoSandboxes();
    },
    RUN_TIMEOUT_MS,
  );
});

describe("the rest of the surface, in this process (Bun)", () => {
  test(
    "exec, streams, files, processes, terminal, suspend/resume and errors on one sandbox",
    async () => {
      const c = client();
      const sbx = await c.sandboxes.create({ template: PYTHON, labels: { suite: "sdk" } });
      try {
        expect((await c.sandboxes.get(sbx.id)).template).toBe(PYTHON);
        expect((await sbx.info()).labels).toEqual({ suite: "sdk" });
        expect((await c.sandboxes.list()).map((s) => s.id)).toContain(sbx.id);

        // A non-zero exit is a result; options reach the command.
        const r = await sbx.exec("cat; echo $GREETING from $(pwd) >&2; exit 3", {
          stdin: "piped\n",
          env: { GREETING: "hello" },
          cwd: "/tmp",
          files: { "/tmp/in.bin": new Uint8Array([0, 255, 1]) },
        });
        expect(r).toMatchObject({
          stdout: "piped\n",
          stderr: "hello from /tmp\n",
          exitCode: 3,
          truncated: false,
        });
        expect((await sbx.exec(["od", "-An", "-tx1", "/tmp/in.bin"])).stdout.trim()).toBe("00 ff 01");

        // Bytes that are not UTF-8 come through exactly.
        const evs = [];
        for await (const ev of sbx.execStream("printf 'a\\377b'; printf err >&2")) evs.push(ev);
        const out = evs.flatMap((e) => (e.type === "stdout" ? [...e.bytes] : []));
        expect(out).toEqual([0x61, 0xff, 0x62]);
        expect(evs.filter((e) => e.type === "stderr").map((e) => (e.type === "exit" ? "" : e.data))).toEqual([
          "err",
        ]);
        expect(evs.at(-1)).toMatchObject({ type: "exit", exitCode: 0 });

        // Leaving a stream early cancels its command: the sandbox is free for the next exec.
        for await (const ev of sbx.execStream("echo started; sleep 60")) {
          expect(ev).toMatchObject({ type: "stdout", data: "started\n" });
          break;
        }
        let after: Awaited<ReturnType<typeof sbx.exec>> | undefined;
        const freed = await waitFor(async () => {
          after = await sbx.exec("echo free").catch((e: unknown) => {
            if (e instanceof SandboxdError && e.code === "busy") return undefined;
            throw e;
          });
          return after !== undefined;
        }, 30_000);
        expect(freed).toBe(true);
        expect(after?.stdout).toBe("free\n");

        // Files: bytes in and out, listing, removal; a missing file is not_found.
        const bytes = new Uint8Array(300_000).map((_, i) => (i * 7) & 0xff);
        expect(await sbx.files.write("/data/blob.bin", bytes)).toEqual({
          path: "/data/blob.bin",
          size: 300_000,
        });
        expect(await sbx.files.read("/data/blob.bin")).toEqual(bytes);
        const listing = await sbx.files.list("/data");
        expect(listing.entries.map((e) => [e.name, e.type, e.size])).toEqual([["blob.bin", "file", 300_000]]);
        await sbx.files.remove("/data/blob.bin");
        const missing = await sbx.files.read("/data/blob.bin").catch((e: unknown) => e);
        expect(missing).toBeInstanceOf(SandboxdError);
        expect(missing).toMatchObject({ code: "not_found", status: 404 });

        // Background processes: followed output and exit; a kill is 137.
        const p = await sbx.processes.start("for i in 1 2 3; do echo p$i; done");
        let followed = "";
        let exit: number | null | undefined;
        for await (const ev of sbx.processes.follow(p.pid)) {
          if (ev.type === "exit") exit = ev.exitCode;
          else followed += ev.data;
        }
        expect(followed).toBe("p1\np2\np3\n");
        expect(exit).toBe(0);
        const sleeper = await sbx.processes.start(["sleep", "300"]);
        expect((await sbx.processes.list()).map((x) => [x.pid, x.running])).toEqual([
          [p.pid, false],
          [sleeper.pid, true],
        ]);
        expect(await sbx.processes.kill(sleeper.pid)).toMatchObject({ running: false, exitCode: 137 });
        expect((await sbx.processes.logs(p.pid)).stdout).toBe("p1\np2\np3\n");

        // The terminal: a resize reaches the shell.
        const term = await sbx.terminal({ cols: 80, rows: 24 });
        let screen = "";
        term.onData((b) => {
          screen += new TextDecoder().decode(b);
        });
        term.resize(132, 43);
        term.write("stty size\n");
        expect(await waitFor(() => /43 132/.test(screen), 30_000)).toBe(true);
        expect((await term.close()).code).toBe(1000);

        // Suspend and resume; another tenant sees nothing.
        expect(await sbx.suspend()).toMatchObject({ id: sbx.id, state: "suspended" });
        expect((await sbx.info()).state).toBe("suspended");
        // Live metrics of a suspended sandbox: its state, and looking leaves it suspended.
        expect(await sbx.metrics()).toMatchObject({ id: sbx.id, state: "suspended", interval_s: 2 });
        expect((await sbx.info()).state).toBe("suspended");
        expect(await sbx.resume()).toMatchObject({ id: sbx.id, state: "running" });
        expect((await sbx.exec("echo back")).stdout).toBe("back\n");
        const foreign = await client(keys.other)
          .sandboxes.get(sbx.id)
          .catch((e: unknown) => e);
        expect(foreign).toMatchObject({ code: "not_found", status: 404 });

        // Deleted under a stream: the service's `error` event is thrown as a SandboxdError.
        const stream = sbx.execStream("echo up; sleep 300", { timeoutSeconds: 600 });
        expect((await stream.next()).value).toMatchObject({ type: "stdout", data: "up\n" });
        const deleting = sbx.delete();
        const ended = await (async () => {
          for await (const ev of stream) return ev;
        })().catch((e: unknown) => e);
        await deleting;
        expect(ended).toBeInstanceOf(SandboxdError);
        expect(ended).toMatchObject({ code: "gone" });
      } finally {
        await sbx.delete().catch(() => {});
      }
      await expectNoSandboxes();
    },
    RUN_TIMEOUT_MS,
  );

  test(
    "Sessions API: one-shot exec and sessions; templates and usage; a key of the wrong api is refused",
    async () => {
      const a = client(keys.live);
      const one = await a.exec({ code: "print(6*7)", templateId: PYTHON });
      expect(one).toMatchObject({ stdout: "42\n", exitCode: 0 });

      const s = await a.sessions.create({ templateId: PYTHON });
      try {
        expect((await s.exec("x = 20\nprint(x + 1)")).stdout).toBe("21\n");
        expect((await s.exec({ commands: [["sh", "-c", "echo session"]] })).stdout).toBe("session\n");
        expect((await a.sessions.list()).map((x) => x.session_id)).toContain(s.id);
        expect((await a.sessions.get(s.id)).templateId).toBe(PYTHON);
        await s.files.write("/tmp/s.txt", "kept");
        const child = await s.fork();
        expect(await child.files.readText("/tmp/s.txt")).toBe("kept");
        await child.delete();
      } finally {
        await s.delete();
      }
      const gone = await s.exec("print(1)").catch((e: unknown) => e);
      expect(gone).toBeInstanceOf(SandboxdError);
      expect([404, 410]).toContain((gone as SandboxdError).status);

      const b = client();
      expect((await b.templates.list()).map((t) => t.id)).toContain(PYTHON);
      expect(await b.templates.wait(PYTHON)).toMatchObject({ id: PYTHON, phase: "Live" });
      expect((await a.templates.list()).find((t) => t.id === PYTHON)).toEqual({ id: PYTHON, ready: true });
      expect((await b.usage()).totals.cpu_core_hours).toBeGreaterThan(0);

      const wrong = await a.sandboxes.list().catch((e: unknown) => e);
      expect(wrong).toBeInstanceOf(SandboxdError);
      expect((wrong as SandboxdError).status).toBe(403);
    },
    RUN_TIMEOUT_MS,
  );

  test(
    "templates: an upload built and waited for, a connect URL to its exposed port, then deleted; a bake that fails is template_failed",
    async () => {
      const scale = client(keys.scale);
      const imgDir = await mkdtemp(join(tmpdir(), "sdk-ts-img-"));
      try {
        const spec = await busyboxImageSpec(imgDir, { config: { ExposedPorts: { "8000/tcp": {} } } });
        const archive = await makeDockerArchive(join(imgDir, "bb.tar"), spec);
        const image = new Uint8Array(await readFile(archive.path));
        expect(await scale.templates.upload({ id: "sdk-bb", image })).toEqual({
          id: "sdk-bb",
          status: "building",
        });
        const phases: string[] = [];
        const t = await scale.templates.wait("sdk-bb", {
          timeoutMs: 180_000,
          onProgress: (x) => phases.push("status" in x ? x.status : x.phase),
        });
        expect(t).toMatchObject({ id: "sdk-bb", status: "ready" });
        expect(phases.at(-1)).toBe("ready");
        expect((await scale.templates.list()).find((x) => x.id === "sdk-bb")).toEqual({
          id: "sdk-bb",
          ready: true,
        });

        // A sandbox of it (the same tenant's Pro key) exposes the image's port to connect URLs.
        const sbx = await client().sandboxes.create({ template: "sdk-bb" });
        try {
          expect(sbx.endpoints).toEqual({ "8000": `${sbx.id}:8000` });
          const link = await sbx.connectUrl({ port: 8000, ttlSeconds: 60 });
          expect(link.url).toStartWith(
            `${service().url.replace(/^http/, "ws")}/v1/sandboxes/${sbx.id}/connect?port=8000`,
          );
          expect(Date.parse(link.expiresAt) - Date.now()).toBeLessThanOrEqual(61_000);
          expect(await sbx.connectUrl({ port: 9, ttlSeconds: 60 }).catch((e: unknown) => e)).toMatchObject({
            code: "port_not_exposed",
            status: 409,
          });
        } finally {
          await sbx.delete();
        }
        await scale.templates.delete("sdk-bb");
        expect(await scale.templates.get("sdk-bb").catch((e: unknown) => e)).toMatchObject({
          code: "not_found",
          status: 404,
        });
      } finally {
        await rm(imgDir, { recursive: true, force: true });
      }

      // A Pro bake: a reference outside the grammar is refused at once; one whose registry does
      // not answer is accepted, ends Failed, and `wait` says why.
      const pro = client();
      expect(
        await pro.templates.bake({ name: "bad", image: "--option" }).catch((e: unknown) => e),
      ).toMatchObject({
        code: "bad_request",
        status: 400,
      });
      const baked = await pro.templates.bake({ name: "nowhere", image: "127.0.0.1:9/none/image:1" });
      expect(baked.id).toBe("nowhere");
      expect(baked.phase).not.toBe("Live");
      const failed = await pro.templates.wait("nowhere", { timeoutMs: 120_000 }).catch((e: unknown) => e);
      expect(failed).toBeInstanceOf(SandboxdError);
      expect(failed).toMatchObject({ code: "template_failed" });
      expect((failed as SandboxdError).message).toMatch(/^template nowhere: [a-z_]+: /);
      await pro.templates.delete("nowhere");
    },
    RUN_TIMEOUT_MS,
  );
});

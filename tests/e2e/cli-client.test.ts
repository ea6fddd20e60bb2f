/**
 * The client CLI (`bin/sandboxd sbx ...`, `bin/sandboxd template ...`) end to end: the real
 * binary, run as a user runs it, against the real service (`bin/sandboxd up`, real VMs under TCG)
 * with SANDBOXD_URL / SANDBOXD_API_KEY in its environment. A template baked by the CLI from a
 * busybox image in a real registry on loopback; create, ls/info with --json, exec (the command's
 * exit code passed through, its output streamed while it runs), cp both ways byte-exact (files and
 * stdin/stdout), fork, suspend/resume, rm and the server's refusal printed as `code: message`
 * (exit 1); snapshots (take, list with filters and --limit, restore in place with the file written
 * after it rolled back, create from one, delete) with the server's 404 (unknown snapshot), 409 (a
 * suspended sandbox, a snapshot of another template) and 400 (another size); timeout and egress;
 * every subcommand's --help and usage errors (exit 2); and `sbx shell` in a real
 * terminal (tmux): `echo $((6*7))` shows 42, a window resize reaches the shell, and the terminal is
 * back in cooked mode after `exit`; on a terminal an upload, a download and a bake end with their
 * progress line on stderr (piped, the cp test sees none).
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { spawn, spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { existsSync } from "node:fs";
import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { REPO, waitFor } from "../support/e2e-service.ts";
import { type LocalRegistry, startBusyboxRegistry } from "../support/registry.ts";
import { useService } from "../support/service.ts";

/** The registry and push, and the bake the later tests use (bound 300 s), once `up` runs. */
const SETUP_TIMEOUT_MS = 360_000;
/** A test runs a few CLI commands (each ~0.5 s of Bun start) and boots a VM at most. */
const TEST_TIMEOUT_MS = 180_000;
/** One CLI command: a harness bound; the bake waits for pull, import, boot and snapshot. */
const CLI_TIMEOUT_MS = 240_000;
/** A harness wait for the shell in tmux to answer on a loaded, emulated guest. */
const PANE_WAIT_MS = 30_000;
const SANDBOXD = join(REPO, "bin/sandboxd");
const TEMPLATE = "clibb";

let reg: LocalRegistry | undefined;
const registry = (): LocalRegistry => {
  if (!reg) throw new Error("the registry did not start (see beforeAll)");
  return reg;
};
let work = "";
let key = "";
const live = new Set<string>();

afterAll(async () => {
  await reg?.stop();
  if (work) await rm(work, { recursive: true, force: true });
});

// The test registry is on loopback: the operator (not a tenant) lets the bake's pull reach it.
const fx = useService({
  prefix: "sbx-e2e-cli-",
  python: false,
  keys: { key: ["acme", "pro"] },
  env: { SANDBOXD_REGISTRY_ALLOW_INTERNAL: "127.0.0.1/32" },
});

// Before the fixture stops `up`: the sandboxes go while `up` still runs, then the registry.
fx.beforeStop(async () => {
  if (key) for (const id of live) await fx.api.delete(`/v1/sandboxes/${id}`, { key }).catch(() => undefined);
});

interface Ran {
  code: number | null;
  stdout: Buffer;
  stderr: string;
  /** Whether the process was still running when `watch` first matched its stdout. */
  runningAtMatch?: boolean;
}

const service = () => fx.svc;

function cliEnv(): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = { ...process.env, SANDBOXD_URL: service().url, SANDBOXD_API_KEY: key };
  delete env.DATABASE_URL;
  return env;
}

/**
 * Runs `bin/sandboxd ARGS` with the server in its environment, `input` on its stdin; `watch`
 * notes whether the process was still running when its stdout first matched (streamed output).
 */
function cli(args: string[], opts: { input?: Uint8Array | string; watch?: RegExp } = {}): Promise<Ran> {
  return new Promise((done, fail) => {
    const child = spawn(SANDBOXD, args, { env: cliEnv(), stdio: ["pipe", "pipe", "pipe"] });
    const out: Buffer[] = [];
    let err = "";
    let exited = false;
    let runningAtMatch: boolean | undefined;
    child.stdout.on("data", (b: Buffer) => {
      out.push(b);
      if (opts.watch && runningAtMatch === undefined && opts.watch.test(Buffer.concat(out).toString())) {
        runningAtMatch = !exited;
      }
    });
    child.stderr.on("data", (b: Buffer) => {
      err += b.toString();
    });
    child.stdin.end(opts.input ?? "");
    const timer = setTimeout(() => child.kill("SIGKILL"), CLI_TIMEOUT_MS);
    child.once("error", fail);
    child.once("exit", () => {
      exited = true;
    });
    child.once("close", (code) => {
      clearTimeout(timer);
      done({ code, stdout: Buffer.concat(out), stderr: err, runningAtMatch });
    });
  });
}

/** A CLI command that must succeed; its stdout as text. */
async function ok(args: string[], input?: string): Promise<string> {
  const r = await cli(args, input === undefined ? {} : { input });
  if (r.code !== 0) throw new Error(`sandboxd ${args.join(" ")} exited ${r.code}: ${r.stderr}`);
  return r.stdout.toString();
}

async function createSandbox(...extra: string[]): Promise<string> {
  const id = (await ok(["sbx", "create", "--template", TEMPLATE, ...extra])).trim();
  expect(id).toMatch(/^sbx_[A-Za-z0-9]+$/);
  live.add(id);
  return id;
}

/**
 * A private tmux server (its own socket under the test's dir, never the user's) with the CLI's
 * environment: `tmux(args)`, a wait for the pane's text to match, and its end.
 */
function tmuxServer() {
  const sock = join(work, `tmux-${Math.random().toString(36).slice(2)}.sock`);
  const tmux = (...args: string[]) => {
    const r = spawnSync("tmux", ["-S", sock, ...args], { encoding: "utf8", env: cliEnv() });
    if (r.status !== 0) throw new Error(`tmux ${args.join(" ")}: ${r.stderr}`);
    return r.stdout;
  };
  const pane = () => tmux("capture-pane", "-p", "-J", "-S", "-200");
  const waitPane = async (re: RegExp) => {
    if (!(await waitFor(() => re.test(pane()), PANE_WAIT_MS))) {
      throw new Error(`the pane never showed ${re}:\n${pane()}`);
    }
  };
  const kill = () => spawnSync("tmux", ["-S", sock, "kill-server"]);
  return { tmux, waitPane, kill };
}

beforeAll(async () => {
  work = await mkdtemp(join(tmpdir(), "sbx-cli-"));
  ({ reg } = await startBusyboxRegistry(work, "cli/bb:1"));
  ({ key } = fx.keys);
  // Baked through the CLI: piped, so no progress line; the last line says it is Live.
  const baked = await cli(["template", "bake", TEMPLATE, `${reg.host}/cli/bb:1`]);
  if (baked.code !== 0) throw new Error(`bake exited ${baked.code}: ${baked.stderr}\n${service().logTail()}`);
  expect(baked.stdout.toString()).toBe(`${TEMPLATE} Live\n`);
  expect(baked.stderr).toBe("");
}, SETUP_TIMEOUT_MS);

describe("sandboxd sbx / template against the real service", () => {
  let id = "";

  test(
    "template ls, sbx create, ls --json, info (text and --json)",
    async () => {
      const templates = JSON.parse(await ok(["template", "ls", "--json"])) as { id: string }[];
      expect(templates.map((t) => t.id)).toContain(TEMPLATE);
      expect(await ok(["template", "ls"])).toMatch(
        new RegExp(`^ID\\s+VISIBILITY\\s+DESCRIPTION\\n(.*\\n)*${TEMPLATE}\\s+private`, "m"),
      );

      id = await createSandbox("--label", "who=cli");
      const listed = JSON.parse(await ok(["sbx", "ls", "--json"])) as { id: string; state: string }[];
      expect(listed.find((s) => s.id === id)).toMatchObject({ id, template: TEMPLATE, state: "running" });
      expect(await ok(["sbx", "ls"])).toMatch(new RegExp(`^${id}\\s+${TEMPLATE}\\s+running$`, "m"));
      const info = JSON.parse(await ok(["sbx", "info", id, "--json"]));
      expect(info).toMatchObject({ id, template: TEMPLATE, state: "running", labels: { who: "cli" } });
      const text = await ok(["sbx", "info", id]);
      expect(text).toMatch(new RegExp(`^id:\\s+${id}$`, "m"));
      expect(text).toMatch(/^labels:\s+who=cli$/m);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "exec: stdout and stderr apart, the exit code passed through, output streamed while it runs",
    async () => {
      const r = await cli(["sbx", "exec", id, "--", "sh", "-c", "echo out; echo err >&2; exit 7"]);
      expect(r.code).toBe(7);
      expect(r.stdout.toString()).toBe("out\n");
      expect(r.stderr).toBe("err\n");
      // Words after the id are the command's own, options included, quoted as typed.
      expect(await ok(["sbx", "exec", id, "echo", "-n", "a b", "$HOME"])).toBe("a b $HOME");
      expect(await ok(["sbx", "exec", "--env", "X=42", id, "echo $X"])).toBe("42\n");
      expect(await ok(["sbx", "exec", "-i", id, "cat"], "from stdin")).toBe("from stdin");
      // The first line arrives while the command still sleeps: the CLI has not exited yet.
      const streamed = await cli(["sbx", "exec", id, "echo first; sleep 3; echo second"], {
        watch: /first\n/,
      });
      expect(streamed.code).toBe(0);
      expect(streamed.stdout.toString()).toBe("first\nsecond\n");
      expect(streamed.runningAtMatch).toBe(true);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "cp: a file up and back down byte-exact, stdin to a sandbox file and a sandbox file to stdout",
    async () => {
      // Every byte value, and more than one chunk of any pipe or socket buffer on the way.
      const blob = randomBytes(3 * 1024 * 1024 + 17);
      const local = join(work, "blob.bin");
      await writeFile(local, blob);
      await ok(["sbx", "cp", local, `${id}:/tmp/`]);
      expect(await ok(["sbx", "exec", id, "wc -c < /tmp/blob.bin"])).toBe(`${blob.length}\n`);
      const back = join(work, "back.bin");
      await ok(["sbx", "cp", `${id}:/tmp/blob.bin`, back]);
      expect(Buffer.compare(await readFile(back), blob)).toBe(0);

      const text = randomBytes(70_000);
      const up = await cli(["sbx", "cp", "-", `${id}:/tmp/in.bin`], { input: text });
      expect(up.code).toBe(0);
      const down = await cli(["sbx", "cp", `${id}:/tmp/in.bin`, "-"]);
      expect(down.code).toBe(0);
      expect(Buffer.compare(down.stdout, text)).toBe(0);
      // Piped: no progress line on stderr.
      expect(up.stderr + down.stderr).toBe("");

      const missing = await cli(["sbx", "cp", `${id}:/tmp/nope`, join(work, "nope")]);
      expect(missing.code).toBe(1);
      expect(missing.stderr).toMatch(/^not_found: /);
      expect(existsSync(join(work, "nope"))).toBe(false);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "fork: a child with the parent's files; suspend and resume; rm, then the server's 404 as code: message",
    async () => {
      const kids = JSON.parse(await ok(["sbx", "fork", id, "--json"])) as { id: string }[];
      expect(kids).toHaveLength(1);
      const kid = kids[0]!.id;
      live.add(kid);
      expect(await ok(["sbx", "exec", kid, "wc -c < /tmp/in.bin"])).toBe("70000\n");

      expect(await ok(["sbx", "suspend", kid])).toBe(`${kid} suspended\n`);
      expect(JSON.parse(await ok(["sbx", "info", kid, "--json"])).state).toBe("suspended");
      const resumed = JSON.parse(await ok(["sbx", "resume", kid, "--json"]));
      expect(resumed).toMatchObject({ id: kid, state: "running" });
      expect(await ok(["sbx", "exec", kid, "echo back"])).toBe("back\n");

      expect(await ok(["sbx", "rm", kid])).toBe(`${kid}\n`);
      live.delete(kid);
      const gone = await cli(["sbx", "info", kid]);
      expect(gone.code).toBe(1);
      expect(gone.stderr).toMatch(/^not_found: .+\n$/);
      expect(gone.stdout.length).toBe(0);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "snapshot, snapshots, restore in place, create --snapshot, snapshot-rm; the server's 404, 409 and 400",
    async () => {
      await ok(["sbx", "exec", id, "echo before > /tmp/mark"]);
      const snap = JSON.parse(
        await ok(["sbx", "snapshot", id, "--name", "cli-snap", "--label", "k=v", "--json"]),
      ) as { id: string };
      expect(snap).toMatchObject({
        state: "ready",
        source_sandbox: id,
        template: TEMPLATE,
        name: "cli-snap",
        labels: { k: "v" },
      });
      expect(snap.id).toMatch(/^snap_/);
      // Text form: key: value lines.
      const text = await ok(["sbx", "snapshot", id]);
      expect(text).toMatch(new RegExp(`^source:\\s+${id}$`, "m"));
      expect(text).toMatch(/^state:\s+ready$/m);
      expect(text).toMatch(/^size:\s+[0-9.]+ (B|KiB|MiB|GiB)$/m);
      const second = /^id:\s+(snap_\S+)$/m.exec(text)?.[1];
      expect(second).toBeDefined();

      // Listing: newest first, filtered as the API filters, cut at --limit.
      const all = JSON.parse(await ok(["sbx", "snapshots", "--json"])) as { id: string }[];
      expect(all.map((s) => s.id)).toEqual([second!, snap.id]);
      const one = JSON.parse(await ok(["sbx", "snapshots", "--limit", "1", "--json"])) as { id: string }[];
      expect(one.map((s) => s.id)).toEqual([second!]);
      const labelled = JSON.parse(await ok(["sbx", "snapshots", "--label", "k:v", "--json"])) as {
        id: string;
      }[];
      expect(labelled.map((s) => s.id)).toEqual([snap.id]);
      expect(JSON.parse(await ok(["sbx", "snapshots", "--state", "failed", "--json"]))).toEqual([]);
      const table = await ok(["sbx", "snapshots", "--sandbox", id]);
      expect(table).toMatch(/^ID\s+NAME\s+STATE\s+SIZE\s+SOURCE\s+TEMPLATE\s+CREATED\n/);
      expect(table).toMatch(
        new RegExp(`^${snap.id}\\s+cli-snap\\s+ready\\s+[0-9.]+ \\w+\\s+${id}\\s+${TEMPLATE}\\s`, "m"),
      );

      // Restore in place: the file written after the snapshot is as it was.
      await ok(["sbx", "exec", id, "echo after > /tmp/mark"]);
      expect(await ok(["sbx", "restore", id, snap.id])).toMatch(
        new RegExp(`^${id} restored to ${snap.id} in [0-9.]+ ms \\(down [0-9.]+ ms\\)\\n$`),
      );
      expect(await ok(["sbx", "exec", id, "cat /tmp/mark"])).toBe("before\n");
      const restored = JSON.parse(await ok(["sbx", "restore", id, second!, "--json"]));
      expect(restored).toMatchObject({ id, state: "running", snapshot: second });
      expect(restored.restore_ms).toBeGreaterThan(0);

      // A new sandbox from the snapshot, with an absolute lifetime.
      const kid = (
        await ok(["sbx", "create", "--snapshot", snap.id, "--timeout", "600", "--on-timeout", "suspend"])
      ).trim();
      live.add(kid);
      expect(await ok(["sbx", "exec", kid, "cat /tmp/mark"])).toBe("before\n");
      expect(JSON.parse(await ok(["sbx", "info", kid, "--json"]))).toMatchObject({
        template: TEMPLATE,
        timeout_seconds: 600,
        on_timeout: "suspend",
      });

      // The server's refusals, as code: message with exit 1.
      const refused = async (args: string[], code: RegExp) => {
        const r = await cli(args);
        expect(`${args.join(" ")}: ${r.code} ${r.stderr}`).toMatch(new RegExp(`: 1 ${code.source}`));
        expect(r.stdout.length).toBe(0);
      };
      await refused(["sbx", "restore", id, "snap_nosuchsnapshot"], /not_found: /);
      await refused(["sbx", "create", "--snapshot", "snap_nosuchsnapshot"], /not_found: /);
      await refused(["sbx", "create", "--snapshot", snap.id, "--vcpus", "2"], /size_unavailable: /);
      expect(await ok(["sbx", "suspend", kid])).toBe(`${kid} suspended\n`);
      await refused(["sbx", "restore", kid, snap.id], /conflict: /);
      expect(await ok(["sbx", "rm", kid])).toBe(`${kid}\n`);
      live.delete(kid);

      // A snapshot of another template cannot be restored into this sandbox: 409 saying so.
      const other = `${TEMPLATE}-2`;
      expect(await ok(["template", "bake", other, `${registry().host}/cli/bb:1`])).toBe(`${other} Live\n`);
      const foreign = (await ok(["sbx", "create", "--template", other])).trim();
      live.add(foreign);
      const foreignSnap = JSON.parse(await ok(["sbx", "snapshot", foreign, "--json"])).id as string;
      await refused(["sbx", "restore", id, foreignSnap], /conflict: .*template/);
      expect(await ok(["sbx", "rm", foreign])).toBe(`${foreign}\n`);
      live.delete(foreign);

      expect(await ok(["sbx", "snapshot-rm", snap.id, second!, foreignSnap])).toBe(
        `${snap.id}\n${second}\n${foreignSnap}\n`,
      );
      expect(JSON.parse(await ok(["sbx", "snapshots", "--json"]))).toEqual([]);
      await refused(["sbx", "snapshot-rm", snap.id], /not_found: /);
      expect(await ok(["template", "rm", other])).toBe(`${other}\n`);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "timeout sets a new lifetime; egress replaces the allow-list, none denies all",
    async () => {
      expect(await ok(["sbx", "timeout", id, "3600", "--on-timeout", "suspend"])).toMatch(
        new RegExp(`^${id} suspend after 3600s at \\S+\\n$`),
      );
      const info = JSON.parse(await ok(["sbx", "info", id, "--json"]));
      expect(info).toMatchObject({ timeout_seconds: 3600, on_timeout: "suspend" });
      expect(await ok(["sbx", "info", id])).toMatch(/^timeout:\s+3600s, then suspend at \S+$/m);
      const set = JSON.parse(await ok(["sbx", "timeout", id, "7200", "--json"]));
      // The sandbox's own action is kept when --on-timeout is absent.
      expect(set).toMatchObject({ id, timeout_seconds: 7200, on_timeout: "suspend" });

      expect(await ok(["sbx", "egress", id, "example.com", "*.example.org"])).toBe(
        `${id} egress example.com *.example.org\n`,
      );
      expect(await ok(["sbx", "egress", id])).toBe(`${id} egress denied\n`);
      expect(JSON.parse(await ok(["sbx", "egress", id, "--json"]))).toEqual({ id, egress: { allow: [] } });
      const bad = await cli(["sbx", "egress", id, "not a host"]);
      expect(bad.code).toBe(1);
      expect(bad.stderr).toMatch(/^bad_request: /);
      const gone = await cli(["sbx", "timeout", "sbx_nosuchsandbox", "60"]);
      expect(gone.code).toBe(1);
      expect(gone.stderr).toMatch(/^not_found: /);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "usage errors exit 2 and every subcommand has --help, through bin/sandboxd",
    async () => {
      const subs = {
        sbx: [
          "create",
          "ls",
          "info",
          "exec",
          "cp",
          "shell",
          "fork",
          "suspend",
          "resume",
          "rm",
          "snapshot",
          "snapshots",
          "snapshot-rm",
          "restore",
          "timeout",
          "egress",
        ],
        template: ["ls", "bake", "rm"],
      };
      for (const [group, names] of Object.entries(subs)) {
        for (const sub of names) {
          const r = await cli([group, sub, "--help"]);
          expect(r.code).toBe(0);
          expect(r.stdout.toString()).toStartWith(`usage: sandboxd ${group} ${sub}`);
        }
      }
      const bad = await cli(["sbx", "exec", id]);
      expect(bad.code).toBe(2);
      expect(bad.stderr).toBe("sandboxd sbx exec: missing CMD (see sandboxd sbx exec --help)\n");
      const wrongKey = await cli(["sbx", "ls", "--api-key", "svc_pro_nope_nope"]);
      expect(wrongKey.code).toBe(1);
      expect(wrongKey.stderr).toMatch(/^unauthorized: /);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "sbx shell in tmux: echo $((6*7)) shows 42, a resize reaches the shell, exit restores the terminal",
    async () => {
      const { tmux, waitPane, kill } = tmuxServer();
      // A private tmux server (its own socket) whose one window runs the CLI itself, no local
      // shell: what is typed can only reach the sandbox's shell. After the CLI, the window
      // reports its exit status and whether the terminal is back in cooked mode with echo.
      const after = `echo "EXIT=$?"; stty -a | grep -o -- '-\\?icanon\\|-\\?echo ' | tr '\\n' ' '; echo; sleep 600`;
      tmux(
        "new-session",
        "-d",
        "-s",
        "cli",
        "-x",
        "100",
        "-y",
        "30",
        `${SANDBOXD} sbx shell ${id}; ${after}`,
      );
      try {
        // Typed at once: keys that come before the shell is up wait in its terminal's input.
        tmux("send-keys", "-t", "cli", "echo $((6*7))", "Enter");
        await waitPane(/^42$/m);
        tmux("send-keys", "-t", "cli", "stty size", "Enter");
        await waitPane(/^30 100$/m);
        tmux("resize-window", "-t", "cli", "-x", "90", "-y", "20");
        tmux("send-keys", "-t", "cli", "stty size", "Enter");
        await waitPane(/^20 90$/m);
        tmux("send-keys", "-t", "cli", "exit", "Enter");
        await waitPane(/^EXIT=0$/m);
        await waitPane(/^icanon echo\s*$/m);
      } finally {
        kill();
      }
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "on a terminal, an upload, a download and a bake show their progress on stderr",
    async () => {
      const local = join(work, "progress.bin");
      await writeFile(local, randomBytes(2 * 1024 * 1024));
      const { tmux, waitPane, kill } = tmuxServer();
      // The window's stdout and stderr are the terminal; `sleep` keeps it open to be read.
      const steps = [
        `${SANDBOXD} sbx cp ${local} ${id}:/tmp/`,
        `${SANDBOXD} sbx cp ${id}:/tmp/progress.bin ${join(work, "progress.back")}`,
        // Baked already: the same bake again is the same template, Live at once.
        `${SANDBOXD} template bake ${TEMPLATE} ${registry().host}/cli/bb:1`,
        "sleep 600",
      ];
      tmux("new-session", "-d", "-s", "progress", "-x", "120", "-y", "30", steps.join("; "));
      try {
        await waitPane(/^upload \/tmp\/progress\.bin: 2\.0 MiB \(\d+\.\d s\)$/m);
        await waitPane(/^download \/tmp\/progress\.bin: 2\.0 MiB \(\d+\.\d s\)$/m);
        await waitPane(new RegExp(`^bake ${TEMPLATE}: Live \\(\\d+\\.\\d s\\)\\n${TEMPLATE} Live$`, "m"));
      } finally {
        kill();
      }
      // The round trip shown was a real one: the file came back byte-exact.
      expect((await readFile(join(work, "progress.back"))).equals(await readFile(local))).toBe(true);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "piped, sbx shell runs its input as a script with its exit code; a shell whose sandbox is removed exits 1",
    async () => {
      const piped = await cli(["sbx", "shell", id], { input: "echo $((6*7))\necho oops >&2\nexit 3\n" });
      expect(piped.code).toBe(3);
      expect(piped.stdout.toString()).toBe("42\n");
      expect(piped.stderr).toBe("oops\n");

      // A terminal left open while the sandbox is removed under it: the CLI says so and exits 1.
      const { tmux, waitPane, kill } = tmuxServer();
      tmux(
        "new-session",
        "-d",
        "-s",
        "gone",
        "-x",
        "100",
        "-y",
        "30",
        `${SANDBOXD} sbx shell ${id}; echo "EXIT=$?"; sleep 600`,
      );
      try {
        tmux("send-keys", "-t", "gone", "echo ready-$((1+1))", "Enter");
        await waitPane(/^ready-2$/m);
        expect(await ok(["sbx", "rm", id])).toBe(`${id}\n`);
        live.delete(id);
        // The gateway's close (1001, sandbox deleted) or the agent's tunnel end, whichever comes first.
        await waitPane(/^sandboxd: terminal closed \(\d{4}: .+\)$/m);
        await waitPane(/^EXIT=1$/m);
      } finally {
        kill();
      }
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a bake the server refuses, and one that fails, exit 1 with code: message",
    async () => {
      // `--` ends the options: the reference goes to the server as typed, which refuses it.
      const refused = await cli(["template", "bake", "bad", "--", "--option"]);
      expect(refused.code).toBe(1);
      expect(refused.stderr).toMatch(/^bad_request: .+\n$/);
      // Nothing listens on port 9: the pull fails and the bake ends Failed, which the CLI waited for.
      const failed = await cli(["template", "bake", "nowhere", "127.0.0.1:9/none/image:1"]);
      expect(failed.code).toBe(1);
      expect(failed.stderr).toMatch(/^template_failed: template nowhere: .+\n$/);
      expect(failed.stdout.length).toBe(0);
      expect(await ok(["template", "rm", "nowhere"])).toBe("nowhere\n");
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "rm the template; nothing is left",
    async () => {
      expect(JSON.parse(await ok(["sbx", "ls", "--json"]))).toEqual([]);
      expect(await ok(["template", "rm", TEMPLATE])).toBe(`${TEMPLATE}\n`);
      const templates = JSON.parse(await ok(["template", "ls", "--json"])) as { id: string }[];
      expect(templates.map((t) => t.id)).not.toContain(TEMPLATE);
    },
    TEST_TIMEOUT_MS,
  );
});

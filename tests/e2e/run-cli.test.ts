/**
 * `bin/sandboxd run` end to end, as a user runs it: the real CLI in a subprocess, a real image
 * archive, a real VM under TCG. Each test also checks that nothing is left behind.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { spawn, spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { busyboxImageSpec, makeDockerArchive, makeOciArchive } from "../fixtures/images.ts";
import { prepareDataDir, removeDataDir } from "../support/e2e-service.ts";

const REPO = resolve(import.meta.dir, "../..");
/**
 * Its own data dir (the guest artifacts copied from the shared test cache): the checks below
 * count every VM dir, temp file and QEMU of the dir, which other files running beside this one
 * would add to in the shared one.
 */
let DATA_DIR = "";
/** Each test boots one to three VMs under TCG (~2 s each here); 120 s covers a loaded CI machine. */
const VM_TEST_TIMEOUT_MS = 120_000;
const scratch = mkdtempSync(join(tmpdir(), "run-cli-"));
const image = join(scratch, "busybox.tar");
const imageUser = join(scratch, "busybox-user.oci.tar");

interface RunResult {
  code: number | null;
  stdout: string;
  stderr: string;
  ms: number;
}

function sandboxd(args: string[], input?: string): Promise<RunResult> {
  const t0 = performance.now();
  return new Promise((done) => {
    const child = spawn(join(REPO, "bin/sandboxd"), args, {
      env: { ...process.env, SANDBOXD_DATA_DIR: DATA_DIR },
      stdio: ["pipe", "pipe", "pipe"],
    });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (b: Buffer) => {
      stdout += b.toString();
    });
    child.stderr.on("data", (b: Buffer) => {
      stderr += b.toString();
    });
    child.stdin.end(input ?? "");
    child.on("close", (code) => done({ code, stdout, stderr, ms: performance.now() - t0 }));
  });
}

/** QEMU processes started for this data directory (the VM dirs live under it). */
function qemuPidsForDataDir(): number[] {
  // Anchored at the program: the jail's unshare and shell name QEMU's argv in theirs too.
  const out = spawnSync("pgrep", ["-f", `^\\S*qemu-system\\S* .*${DATA_DIR}/vms/`], {
    encoding: "utf8",
  }).stdout;
  return out.split("\n").filter(Boolean).map(Number);
}

function expectNothingLeft(): void {
  const vms = join(DATA_DIR, "vms");
  expect(existsSync(vms) ? readdirSync(vms) : []).toEqual([]);
  const tmp = join(DATA_DIR, "tmp");
  expect(existsSync(tmp) ? readdirSync(tmp) : []).toEqual([]);
  expect(qemuPidsForDataDir()).toEqual([]);
}

beforeAll(async () => {
  DATA_DIR = await prepareDataDir("sbx-e2e-run-", { python: false });
  await makeDockerArchive(image, await busyboxImageSpec(join(scratch, "a"), { features: true }));
  await makeOciArchive(
    imageUser,
    await busyboxImageSpec(join(scratch, "b"), {
      config: { User: "app", WorkingDir: "/home/app", Cmd: null, Entrypoint: ["id"] },
      gzipLayers: true,
    }),
  );
});

afterAll(async () => {
  rmSync(scratch, { recursive: true, force: true });
  if (DATA_DIR) await removeDataDir(DATA_DIR);
});

describe("sandboxd run", () => {
  test(
    "runs CMD with the image's Env and WorkingDir, keeps stderr apart, exits with its code",
    async () => {
      const r = await sandboxd([
        "run",
        "--image",
        image,
        "--",
        "sh",
        "-c",
        'echo "$FIXTURE_GREETING"; pwd; echo to-stderr >&2; exit 7',
      ]);
      expect(r.stdout).toBe("hello-from-image\n/app\n");
      expect(r.stderr).toContain("to-stderr\n");
      expect(r.stderr).not.toContain("hello-from-image");
      expect(r.code).toBe(7);
      const timing = /tcg|kvm: import \d+ ms, boot (\d+) ms, exec (\d+) ms/.exec(r.stderr);
      expect(timing).not.toBeNull();
      console.log(`[run-cli] wall ${r.ms.toFixed(0)} ms; ${timing?.[0]}`);
      expectNothingLeft();
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "with no CMD runs the image's Entrypoint+Cmd; -i feeds our stdin",
    async () => {
      const r = await sandboxd(["run", "-i", "--image", image], "echo from-stdin; cat hello.txt; exit 3\n");
      expect(r.stdout).toBe("from-stdin\nhello from /app\n");
      expect(r.code).toBe(3);
      expectNothingLeft();
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "the image's layers arrive intact: whiteouts, opaque dirs, hardlinks, symlinks, modes, owners",
    async () => {
      const script = [
        "ls /data",
        "ls /opq",
        "stat -c '%a %u:%g' /data/owned.bin /data/private",
        '[ "$(stat -c %i /data/hard-a)" = "$(stat -c %i /data/hard-b)" ] && echo same-inode',
        "readlink /data/rel-link; readlink /data/abs-link",
        "cat /data/rel-link",
      ].join("; ");
      const r = await sandboxd(["run", "--image", image, "--", "sh", "-c", script]);
      expect(r.code).toBe(0);
      expect(r.stdout).toBe(
        [
          "abs-link\nhard-a\nhard-b\nkept.txt\nowned.bin\nprivate\nrel-link",
          "new-c",
          "4751 1234:5678\n700 1000:1000",
          "same-inode",
          "kept.txt\n/etc/passwd",
          "kept\n",
        ].join("\n"),
      );
      expectNothingLeft();
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "an oci-archive with User and Entrypoint runs as that user in its WorkingDir",
    async () => {
      const r = await sandboxd(["run", "--image", imageUser, "--", "-u"]);
      expect(r.stdout).toBe("1000\n");
      expect(r.code).toBe(0);
      const r2 = await sandboxd(["run", "--image", imageUser]);
      expect(r2.stdout).toContain("uid=1000(app) gid=1000(app)");
      expectNothingLeft();
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "a missing command exits 127 with the reason on stderr",
    async () => {
      const r = await sandboxd(["run", "--image", image, "--", "no-such-program", "x"]);
      expect(r.code).toBe(127);
      expect(r.stderr).toContain("no-such-program");
      expect(r.stdout).toBe("");
      expectNothingLeft();
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "--timeout kills the whole process tree and exits 137",
    async () => {
      const r = await sandboxd([
        "run",
        "--timeout",
        "2",
        "--image",
        image,
        "--",
        "sh",
        "-c",
        "sleep 60 & sleep 60",
      ]);
      expect(r.code).toBe(137);
      expect(r.stderr).toContain("timed out");
      // 2 s timeout plus a ~2 s TCG boot; 30 s would mean the timeout did not fire.
      expect(r.ms).toBeLessThan(30_000);
      expectNothingLeft();
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "bad input fails clearly with 125 and leaves nothing",
    async () => {
      const notTar = join(scratch, "not-a-tar.tar");
      await Bun.write(notTar, "this is not an archive\n".repeat(100));
      const r = await sandboxd(["run", "--image", notTar, "--", "true"]);
      expect(r.code).toBe(125);
      expect(r.stderr).toContain("image_not_tar");
      const r2 = await sandboxd(["run", "--image", image, "--mem", "lots", "--", "true"]);
      expect(r2.code).toBe(125);
      expect(r2.stderr).toContain("--mem must be an integer");
      const r3 = await sandboxd(["run", "--", "true"]);
      expect(r3.code).toBe(125);
      expect(r3.stderr).toContain("--image");
      expectNothingLeft();
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "kill -9 of the CLI mid-run takes its QEMU down; the next run reclaims the directory",
    async () => {
      const child = spawn(join(REPO, "bin/sandboxd"), ["run", "--image", image, "--", "sleep", "60"], {
        env: { ...process.env, SANDBOXD_DATA_DIR: DATA_DIR },
        stdio: "ignore",
      });
      // Wait until its VM is up (a QEMU for our data dir exists), bounded by a cold boot.
      const deadline = performance.now() + 60_000;
      while (qemuPidsForDataDir().length === 0 && performance.now() < deadline) await Bun.sleep(100);
      expect(qemuPidsForDataDir().length).toBe(1);
      // bin/sandboxd execs bun, so the child pid is the CLI process itself.
      process.kill(child.pid!, "SIGKILL");
      const gone = performance.now() + 10_000;
      while (qemuPidsForDataDir().length > 0 && performance.now() < gone) await Bun.sleep(50);
      expect(qemuPidsForDataDir()).toEqual([]);
      // Its directory is still there (nobody removed it)...
      expect(readdirSync(join(DATA_DIR, "vms")).length).toBe(1);
      // ...until the next run reaps what dead owners left.
      const r = await sandboxd(["run", "--image", image, "--", "true"]);
      expect(r.code).toBe(0);
      expectNothingLeft();
    },
    VM_TEST_TIMEOUT_MS,
  );
});

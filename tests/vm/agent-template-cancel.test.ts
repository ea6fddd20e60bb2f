import { afterAll, beforeAll, expect, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { copyFile, mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { SnapshotDriver } from "../../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { startAgentServer } from "../../agent/server.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import { AgentHttpClient } from "../../gateway/agents/client.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import { leftovers, TEST_CACHE_DIR, tempStateDir } from "../support/real-vm.ts";

/**
 * Deleting a template while its image is being imported ends the import at once: through the real
 * agent (HTTP API, snapshot driver, the real importer and its tools) a bake of a big image is
 * deleted once mid-scan (the in-process stage) and once while umoci runs (a tool), and each time
 * the import stops within CANCEL_BOUND_MS, leaves nothing in the import's work dir or the image
 * cache, and leaves no tool running. A third bake of the same image is then built and serves.
 */

/** Builds one VM under TCG and imports a ~200 MB image three times on a shared 2-core host. */
const TEST_TIMEOUT_MS = 300_000;
/**
 * Every import stage checks the cancel per 256 KiB chunk or directory, or has its tool's process
 * group killed; removing the partial files takes a fraction of a second. 3 s is that with room
 * for a CPU shared with other work, and still far below the seconds the import itself takes.
 */
const CANCEL_BOUND_MS = 3_000;
/**
 * Random bytes (incompressible, hashed and copied by every stage): big enough that the scan and
 * each tool take a second or more under TCG-loaded CPUs, so the delete lands inside the stage.
 */
const BIG_FILE_BYTES = 48 * 1024 * 1024;
const BIG_FILES = 4;
/** How often the test looks for the stage it waits for: a stage lasts far longer. */
const POLL_MS = 5;
const SECRET = "test-secret-0123456789abcdef-0123456789";
const CREDS = { id: "test-agent", key: SECRET };

let scratch: string;
let image: string;

beforeAll(async () => {
  scratch = await mkdtemp(join(tmpdir(), "sbx-cancel-"));
  const spec = await busyboxImageSpec(scratch);
  const big = Array.from({ length: BIG_FILES }, (_, i) => ({
    name: `big/${i}.bin`,
    content: randomBytes(BIG_FILE_BYTES),
  }));
  spec.layers.push([{ name: "big", type: "directory" }, ...big]);
  image = (await makeDockerArchive(join(scratch, "big.tar"), spec)).path;
  await rm(join(scratch, "busybox-rootfs"), { recursive: true, force: true });
}, TEST_TIMEOUT_MS);

afterAll(async () => {
  if (scratch) await rm(scratch, { recursive: true, force: true });
});

function entries(dir: string): string[] {
  return existsSync(dir) ? readdirSync(dir) : [];
}

/** Processes (other than this one) whose command line names a path under `dir`. */
function processesNaming(dir: string): string[] {
  const out: string[] = [];
  for (const p of readdirSync("/proc")) {
    if (!/^\d+$/.test(p) || Number(p) === process.pid) continue;
    try {
      const cmd = readFileSync(`/proc/${p}/cmdline`, "utf8").replaceAll("\0", " ");
      if (cmd.includes(dir)) out.push(`${p}: ${cmd.slice(0, 200)}`);
    } catch {
      // exited meanwhile
    }
  }
  return out;
}

async function until(what: string, ok: () => boolean, timeoutMs: number): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!ok()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await Bun.sleep(POLL_MS);
  }
}

test(
  "a template deleted mid-import stops its import at once, leaves no files or tools, and the image bakes again",
  async () => {
    const stateDir = await tempStateDir();
    // The import cache of this agent alone, so that what is left in it is this test's.
    const cacheDir = await mkdtemp(join(tmpdir(), "sbx-cancel-cache-"));
    const logs: string[] = [];
    const log = (m: string) => logs.push(m);
    const artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });
    const driver = await SnapshotDriver.create({ cacheDir, stateDir, artifacts, log });
    const manager = await SandboxManager.open({ driver, stateDir, log });
    const uploads = join(stateDir, "uploads");
    // The agent's real server: uploads stream to disk with no body-size cap.
    const server = startAgentServer({
      manager,
      credentials: CREDS,
      uploadDir: uploads,
      hostname: "127.0.0.1",
      port: 0,
      version: "test",
      log,
    });
    const client = new AgentHttpClient({ baseUrl: server.url, agentId: CREDS.id, key: SECRET });
    const work = join(cacheDir, "tmp");
    const bake = async () => {
      const upload = join(scratch, "upload.tar");
      await copyFile(image, upload);
      await client.buildTemplate("big", { kind: "upload", path: upload, memMib: 256, vcpuCount: 1 });
    };
    /** Deletes the template and measures until its import has stopped and cleaned up. */
    const deleteAndWatch = async (stage: string) => {
      const t0 = performance.now();
      await client.deleteTemplate("big");
      await until(
        `the ${stage} import to stop`,
        () => entries(work).length === 0 && processesNaming(cacheDir).length === 0,
        30_000,
      );
      const ms = performance.now() - t0;
      console.log(
        `cancel figures: deleted during ${stage}, import stopped and cleaned up in ${ms.toFixed(0)} ms`,
      );
      expect(ms).toBeLessThan(CANCEL_BOUND_MS);
      expect(entries(join(cacheDir, "images"))).toEqual([]);
      expect(logs.filter((l) => l.includes("image: imported"))).toEqual([]);
      // The upload the agent owned goes with the build.
      await until("the upload to be removed", () => entries(uploads).length === 0, 30_000);
    };
    try {
      // 1. Deleted while the importer itself reads the archive (before any tool starts).
      await bake();
      await until("the import's work dir", () => entries(work).length > 0, 60_000);
      expect(logs.some((l) => l.includes("image: scanned"))).toBe(false);
      await deleteAndWatch("the scan");
      expect(logs.some((l) => l.includes("image: scanned"))).toBe(false);

      // 2. Deleted while umoci unpacks the layers (a tool, killed with its process group).
      logs.length = 0;
      await bake();
      await until("umoci to run", () => processesNaming(cacheDir).some((p) => p.includes("umoci")), 120_000);
      await deleteAndWatch("umoci");
      expect(logs.some((l) => l.includes("run: mkfs.ext4"))).toBe(false);

      // 3. The same image bakes again from scratch and serves.
      logs.length = 0;
      await bake();
      for (let i = 0; ; i++) {
        const st = await client.templateStatus("big");
        if (st.status === "ready") break;
        if (st.status === "failed" || i > 2400) throw new Error(`bake: ${JSON.stringify(st)}`);
        await Bun.sleep(100);
      }
      expect(entries(join(cacheDir, "images")).length).toBe(1);
      expect(entries(work)).toEqual([]);
      const vm = await manager.create("big", { kind: "sandbox" });
      const r = await manager.exec(vm.vmId, {
        files: [],
        run: { kind: "shell", command: "wc -c < /big/3.bin" },
        timeoutMs: 30_000,
      });
      expect(r.stdout.trim()).toBe(String(BIG_FILE_BYTES));
      await manager.destroy(vm.vmId, { force: true });
      await client.deleteTemplate("big");
    } finally {
      for (const s of manager.list()) await manager.destroy(s.id, { force: true });
      await server.stop();
      await manager.detach();
      const left = await leftovers(stateDir);
      await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
      await rm(stateDir, { recursive: true, force: true });
      await rm(cacheDir, { recursive: true, force: true });
      expect(left).toEqual({ qemus: [], vmDirs: [] });
    }
  },
  TEST_TIMEOUT_MS,
);

/**
 * A template reaches an agent that joins after its build by a COPY of its frozen files
 * (docs/templates.md "Agents that join later"), with REAL VMs under TCG on two snapshot-driver
 * agents behind a real routing gateway (PGlite). The template is a sessions-API upload: its image
 * is not kept after the build, so a copy is the only way it can reach the second agent. Shown:
 * the gateway, from the late agent's heartbeat, streams the first agent's bundle into it; the
 * late agent never builds (its driver logs a copy, no boot), holds the template at the size it
 * was frozen with, and with the first agent gone serves a session from it by restore (an exec in
 * it answers). The copy's time is printed (TEMPLATE_COPY_FIGURES). Nothing is left: no QEMU, no
 * VM dir, no RAM file once the template is deleted.
 */
import { afterAll, afterEach, expect, test } from "bun:test";
import { existsSync, readdirSync } from "node:fs";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { eq } from "drizzle-orm";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { SnapshotDriver } from "../../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { agents } from "../../db/schema/agents.ts";
import { templates } from "../../db/schema/templates.ts";
import { AgentHttpClient } from "../../gateway/agents/client.ts";
import { createKey } from "../../gateway/auth/keys.ts";
import { callGateway, startEnrolledAgent, startRoutingGateway } from "../support/agents.ts";
import {
  busyboxArchive,
  leftovers,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
} from "../support/real-vm.ts";
import { until } from "../support/until.ts";

const SECRET = "copy-test-agent-secret-0123456789abcdef-xyz";
const HB_MS = 200;
const STALE_MS = 1_500;
/** Two template restores and one build under TCG on a loaded 2-core host. */
const VM_TEST_TIMEOUT_MS = 400_000;
/** A busybox build under TCG takes ~10 s alone; generous for a loaded host. */
const BUILD_MS = 240_000;
/** The copy: a 256 MiB RAM file (mostly holes) and a few MiB of disks through the gateway. */
const COPY_MS = 60_000;

const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});
afterAll(removeBusyboxArchive);

const api = callGateway;

/** Polls `probe` until it answers a value; throws naming `what` past `ms`. */
async function settle<T>(
  what: string,
  ms: number,
  probe: () => T | undefined | Promise<T | undefined>,
): Promise<T> {
  let v: T | undefined;
  const answered = async () => {
    v = await probe();
    return v !== undefined;
  };
  await until(answered, ms, 100).catch((err) => {
    throw new Error(`${what}: ${err}`);
  });
  return v as T;
}

/** A snapshot-driver agent enrolled at `gw`, with its own state and image cache dirs. */
async function agent(gw: Awaited<ReturnType<typeof startRoutingGateway>>, id: string, cacheDir: string) {
  const stateDir = await tempStateDir();
  const log: string[] = [];
  const artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });
  const driver = await SnapshotDriver.create({ cacheDir, stateDir, artifacts, log: (l) => log.push(l) });
  const manager = await SandboxManager.open({ driver, stateDir, capacity: { slots: 4 } });
  const started = await startEnrolledAgent({
    gw,
    agentSecret: SECRET,
    manager,
    stateDir,
    id,
    region: "eu",
    intervalMs: HB_MS,
  });
  let stopped = false;
  const stop = async () => {
    if (stopped) return;
    stopped = true;
    started.hb.stop();
    await started.server.stop();
  };
  cleanups.push(async () => {
    await stop();
    for (const s of manager.list()) await manager.destroy(s.id, { force: true });
    await manager.detach();
    const left = await leftovers(stateDir);
    await rm(stateDir, { recursive: true, force: true });
    await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
    expect(left).toEqual({ qemus: [], vmDirs: [] });
  });
  await started.hb.first;
  const client = new AgentHttpClient({
    baseUrl: started.server.url,
    agentId: started.credentials.id,
    key: started.credentials.key,
  });
  return { manager, log, stop, stateDir, client };
}

test(
  "an uploaded template reaches an agent that joins later as a copy, and serves there by restore",
  async () => {
    const gwLog: string[] = [];
    const gw = await startRoutingGateway({
      agentSecret: SECRET,
      staleAfterMs: STALE_MS,
      agentWaitMs: 20_000,
      onCleanup: (c) => cleanups.push(c),
      log: (l) => gwLog.push(l),
    });
    const key = await gw.withDb(
      async (db) => (await createKey(db, gw.config.keyPepper, { tenant: "copier", tier: "scale" })).key,
    );
    const a = await agent(gw, "first", TEST_CACHE_DIR);

    // The upload builds on the one agent live.
    const image = new Uint8Array(await readFile(await busyboxArchive()));
    const reg = await api(gw.url, key, "POST", "/v1/templates?id=copied", image);
    expect(reg.status).toBe(202);
    await settle("the build", BUILD_MS, async () => {
      const t = (await (await api(gw.url, key, "GET", "/v1/templates/copied")).json()) as { status: string };
      if (t.status === "failed") throw new Error(`build failed: ${JSON.stringify(t)}`);
      return t.status === "ready" ? t : undefined;
    });
    const [row] = await gw.withDb((db) => db.select().from(templates).where(eq(templates.id, "copied")));
    const ref = row!.agentRef;
    expect(row!.image).toBeNull(); // an upload: nothing to rebuild it from
    expect(a.manager.templates.status(ref).status).toBe("ready");

    // A second agent joins: its first heartbeat has the gateway copy the template into it.
    const cacheB = await mkdtemp(join(tmpdir(), "sbx-copy-cache-"));
    cleanups.push(() => rm(cacheB, { recursive: true, force: true }));
    // The first agent's next heartbeat reports it: the gateway now knows whom to copy from.
    await settle("the first agent's report", 10_000, async () => {
      const [r] = await gw.withDb((db) => db.select().from(agents).where(eq(agents.id, "first")));
      return r?.templates.includes(ref) ? true : undefined;
    });
    const t0 = performance.now();
    const b = await agent(gw, "late", cacheB);
    const status = await settle("the copy", COPY_MS, () => {
      let s: ReturnType<typeof b.manager.templates.status>;
      try {
        s = b.manager.templates.status(ref);
      } catch {
        return undefined; // not asked yet
      }
      if (s.status === "failed")
        throw new Error(`copy failed: ${JSON.stringify(s)}\n${b.log.join("\n")}\n${gwLog.join("\n")}`);
      return s.status === "ready" ? s : undefined;
    }).catch((err) => {
      throw new Error(`${err}\ngateway: ${gwLog.join("\n")}\nlate agent: ${b.log.join("\n")}`);
    });
    const copyMs = performance.now() - t0;
    expect(status.phase).toBe("Live");
    // Copied, not built: no image import, no boot on the late agent; its cache holds only the
    // copied base (an entry of its own), no imported image.
    expect(b.log.some((l) => l.includes("copied in"))).toBe(true);
    expect(b.log.some((l) => l.includes("frozen:"))).toBe(false);
    expect(readdirSync(join(cacheB, "images")).sort()).toEqual(["copied"]);
    // The size it was frozen with on the first agent (its default: the upload named none).
    expect(b.manager.templates.sizeOf(ref)).toEqual({ memMib: 256, vcpus: 1 });

    // The agent API refuses what it cannot serve: a bundle of a template it does not have, a
    // copy onto a template it holds (before a byte is staged: 409), and a body that is not a
    // bundle (staged, then the copy fails with the reason; nothing of it is left).
    const code = (p: Promise<unknown>) =>
      p.then(
        () => "ok",
        (e: unknown) => (e instanceof SandboxdError ? e.code : String(e)),
      );
    expect(await code(b.client.exportTemplate("copier.nope"))).toBe("not_found");
    // A body that never ends: only a refusal before staging can answer it.
    const endless = new ReadableStream<Uint8Array>({ pull: (ctl) => ctl.enqueue(new Uint8Array(65536)) });
    expect(await code(b.client.copyTemplate(ref, endless))).toBe("conflict");
    await b.client.copyTemplate("copier.junk", new Response("GET / HTTP/1.1\r\n\r\n").body!);
    const junk = await settle("the junk copy's end", 30_000, async () => {
      const st = await b.client.templateStatus("copier.junk");
      return st.status === "building" ? undefined : st;
    });
    expect(junk.status).toBe("failed");
    expect(junk.error).toMatch(/bad magic|template/);
    expect(readdirSync(join(b.stateDir, "uploads"))).toEqual([]);
    await b.client.deleteTemplate("copier.junk");

    // The first agent gone: a session can only be placed on the late one, by restore.
    await a.stop();
    await Bun.sleep(STALE_MS + 2 * HB_MS);
    const created = await api(gw.url, key, "POST", "/v1/sessions", { template_id: "copied" });
    expect(created.status).toBe(201);
    const session = ((await created.json()) as { session_id: string }).session_id;
    expect(b.manager.list()).toHaveLength(1);
    const ran = await api(gw.url, key, "POST", `/v1/sessions/${session}/exec`, {
      commands: [["sh", "-c", "echo restored-$((6*7))"]],
    });
    expect(ran.status).toBe(200);
    expect(JSON.stringify(await ran.json())).toContain("restored-42");
    expect((await api(gw.url, key, "DELETE", `/v1/sessions/${session}`)).status).toBeLessThan(300);
    console.log(`TEMPLATE_COPY_FIGURES ${JSON.stringify({ join_to_copied_ms: Math.round(copyMs) })}`);

    // Deleted on the late agent: its RAM file goes with it (the first agent's with its cleanup).
    await b.manager.deleteTemplate(ref);
    const shm = defaultShmRoot(b.stateDir);
    expect(existsSync(shm) ? readdirSync(shm).filter((f) => f.endsWith(".mem")) : []).toEqual([]);
    await a.manager.deleteTemplate(ref);
  },
  VM_TEST_TIMEOUT_MS,
);

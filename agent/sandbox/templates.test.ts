/**
 * The template registry's bake phases (docs/templates.md "Rules of templates") as a build moves, with a driver that stands in
 * for the VM layer so each step is held until the test lets it go: Pending while queued behind
 * `MAX_CONCURRENT_BUILDS` builds, Converting, Distributing, Live; a failure is Failed with the
 * driver's reason. Real records on disk.
 */
import { afterAll, afterEach, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readFileSync } from "node:fs";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { SandboxdError } from "../../contracts/errors.ts";
import { busyboxImageSpec, makeOciArchive } from "../../tests/fixtures/images.ts";
import { type LocalRegistry, REGISTRY_BIN, startRegistry } from "../../tests/support/registry.ts";
import { EgressFence } from "../egress/fence.ts";
import { runTool } from "../host/tool.ts";
import { pullImage } from "../image/pull.ts";
import type { BuildPhase, PreparedTemplate, SandboxDriver, TemplateInput } from "./drivers/driver.ts";
import { fencedRegistry } from "./drivers/snapshot.ts";
import { templateRecords } from "./records.ts";
import { buildOwner, MAX_CONCURRENT_BUILDS, TemplateRegistry } from "./templates.ts";
import { tenantErrorText } from "./tenant-error.ts";

interface Held {
  onPhase?: (p: BuildPhase) => void;
  finish: (fail?: string) => void;
}

/** A driver whose prepareTemplate reports Converting and waits for the test. */
function heldDriver() {
  const held = new Map<string, Held>();
  const driver = {
    prepareTemplate(
      id: string,
      _input: TemplateInput,
      _signal: AbortSignal,
      onPhase?: (p: BuildPhase) => void,
    ): Promise<PreparedTemplate> {
      onPhase?.("Converting");
      return new Promise((resolve, reject) => {
        held.set(id, {
          ...(onPhase ? { onPhase } : {}),
          finish: (fail) =>
            fail
              ? reject(new SandboxdError("image_pull_failed", fail))
              : resolve({ image: {} as PreparedTemplate["image"], exposedPorts: [8080] }),
        });
      });
    },
    dropTemplate: async () => {},
    restoreTemplate: async () => {},
  } as unknown as SandboxDriver;
  return { driver, held };
}

const dirs: string[] = [];
afterEach(async () => {
  for (const d of dirs.splice(0)) await rm(d, { recursive: true, force: true });
});

/** A fresh directory for a registry's records, removed after the test. */
async function scratchDir(): Promise<string> {
  const dir = await mkdtemp(join(tmpdir(), "sbx-tpl-"));
  dirs.push(dir);
  return dir;
}

/** Until `cond` holds: polled every 5 ms, bounded at 10 s (a loaded host) and asserted. */
async function until(cond: () => boolean): Promise<void> {
  for (let i = 0; i < 2000 && !cond(); i++) await Bun.sleep(5);
  expect(cond()).toBe(true);
}

describe("TemplateRegistry delete while VMs run (docs/templates.md#rules-of-templates)", () => {
  test("deferred: gone for status and spawns, its ref cannot be rebuilt, kept across a restart, then removed", async () => {
    // A driver that builds at once, with an image config a record can hold.
    const image = {
      env: [],
      workingDir: "/",
      entrypoint: [],
      cmd: ["sh"],
      user: { uid: 0, gid: 0, name: "root" },
      digest: "sha256:0",
      exposedPorts: [],
    };
    const driver = {
      prepareTemplate: async () => ({ image, exposedPorts: [] }),
      dropTemplate: async () => {},
      restoreTemplate: async () => {},
    } as unknown as SandboxDriver;
    const dir = await scratchDir();
    const reg = new TemplateRegistry(driver, templateRecords(dir), () => {});
    reg.build("acme.tag.t", { kind: "oci", image: "r.example/x:1" });
    await reg.settled("acme.tag.t");
    expect(reg.ready("acme.tag.t").id).toBe("acme.tag.t");

    expect(await reg.delete("acme.tag.t", true)).toBe("deferred");
    const code = (f: () => unknown) => {
      try {
        f();
        return "none";
      } catch (err) {
        return (err as SandboxdError).code;
      }
    };
    expect(code(() => reg.ready("acme.tag.t"))).toBe("not_found");
    expect(code(() => reg.status("acme.tag.t"))).toBe("not_found");
    expect(code(() => reg.build("acme.tag.t", { kind: "oci", image: "r.example/x:1" }))).toBe("conflict");
    expect(reg.ids()).toEqual([]);
    expect(reg.deletingIds()).toEqual(["acme.tag.t"]);

    // A restarted agent reads the promise back from the record.
    const again = new TemplateRegistry(driver, templateRecords(dir), () => {});
    await again.load();
    expect(again.deletingIds()).toEqual(["acme.tag.t"]);
    expect(code(() => again.ready("acme.tag.t"))).toBe("not_found");
    // The last VM ended: removed, record and all.
    expect(await again.delete("acme.tag.t", false)).toBe("deleted");
    expect(again.deletingIds()).toEqual([]);
    expect(existsSync(join(dir, "records", "templates", "acme.tag.t.json"))).toBe(false);
  });
});

describe("TemplateRegistry phases", () => {
  test("Pending while queued, then Converting, Distributing, Live; a failure is Failed with its reason", async () => {
    const { driver, held } = heldDriver();
    const reg = new TemplateRegistry(driver, templateRecords(await scratchDir()), () => {});
    const ids = Array.from({ length: MAX_CONCURRENT_BUILDS + 1 }, (_, i) => `t${i}`);
    for (const id of ids) reg.build(id, { kind: "oci", image: "r.example/x:1" });
    const last = ids.at(-1)!;
    await until(() => held.size === MAX_CONCURRENT_BUILDS);
    for (const id of ids.slice(0, -1)) expect(reg.status(id).phase).toBe("Converting");
    expect(reg.status(last)).toMatchObject({ status: "building", phase: "Pending" });
    expect(reg.status(last).telemetry.pending_ms).toBeUndefined();

    // The first build registers its files (Distributing), then is Live with its ports.
    held.get("t0")!.onPhase?.("Distributing");
    expect(reg.status("t0").phase).toBe("Distributing");
    held.get("t0")!.finish();
    await reg.settled("t0");
    expect(reg.status("t0")).toMatchObject({ status: "ready", phase: "Live", exposedPorts: [8080] });
    // Its slot goes to the queued one.
    await until(() => held.has(last));
    expect(reg.status(last).phase).toBe("Converting");
    expect(reg.status(last).telemetry.pending_ms).toBeGreaterThanOrEqual(0);

    held.get("t1")!.finish("manifest unknown");
    await reg.settled("t1");
    expect(reg.status("t1")).toMatchObject({ status: "failed", phase: "Failed" });
    expect(reg.status("t1").error).toContain("manifest unknown");
    held.get(last)!.finish();
    await reg.settled(last);
    expect(reg.status(last).phase).toBe("Live");

    // A deleted queued build never starts.
    for (const id of ["q0", "q1", "q2"]) reg.build(id, { kind: "oci", image: "r.example/x:1" });
    // Both slots' builds reach the driver, in no set order (each start awaits its own I/O).
    await until(() => held.has("q0") && held.has("q1"));
    await reg.delete("q2", false);
    held.get("q0")!.finish();
    held.get("q1")!.finish();
    // Both slots are free once both have settled: a q2 still queued would have started then.
    await reg.settled("q0");
    await reg.settled("q1");
    await Bun.sleep(50);
    expect(held.has("q2")).toBe(false);
  });
});

/** Whether `pid` is gone (or a zombie no one has reaped yet: it runs nothing). */
function processGone(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    return stat.slice(stat.lastIndexOf(")") + 2).startsWith("Z");
  } catch {
    return true;
  }
}

describe("build slots shared between tenants", () => {
  test("a tenant's queue holds no more than its turn: the other tenant's bake starts next", async () => {
    const { driver, held } = heldDriver();
    const reg = new TemplateRegistry(driver, templateRecords(await scratchDir()), () => {});
    // Tenant A queues four bakes first; alone, it uses every slot.
    const a = ["ten_a.a0", "ten_a.a1", "ten_a.a2", "ten_a.a3"];
    for (const id of a) reg.build(id, { kind: "oci", image: "r.example/x:1", tenantId: "ten_a" });
    await until(() => held.size === MAX_CONCURRENT_BUILDS);
    // Then B queues two: the next free slot is B's, not A's third.
    for (const id of ["ten_b.b0", "ten_b.b1"]) reg.build(id, { kind: "archive", path: "/nonexistent" });
    const want = { running: { ten_a: 2 }, waiting: { ten_a: 2, ten_b: 2 } };
    await until(() => Bun.deepEquals(reg.slotsByOwner(), want));
    held.get("ten_a.a0")!.finish();
    await until(() => held.has("ten_b.b0"));
    expect(held.has("ten_a.a2")).toBe(false);
    expect(reg.slotsByOwner().running).toEqual({ ten_a: 1, ten_b: 1 });
    // A's build ends: A runs none, B runs one, so A's next bake takes the slot, not B's second.
    held.get("ten_a.a1")!.finish();
    await until(() => held.has("ten_a.a2"));
    expect(held.has("ten_b.b1")).toBe(false);
    expect(reg.slotsByOwner().running).toEqual({ ten_a: 1, ten_b: 1 });
    held.get("ten_b.b0")!.finish();
    await until(() => held.has("ten_b.b1"));
    expect(held.has("ten_a.a3")).toBe(false);
    for (const id of ["ten_a.a2", "ten_b.b1"]) held.get(id)!.finish();
    await until(() => held.has("ten_a.a3"));
    held.get("ten_a.a3")!.finish();
    for (const id of [...a, "ten_b.b0", "ten_b.b1"]) await reg.settled(id);
    expect(reg.slotsByOwner()).toEqual({ running: {}, waiting: {} });
  });

  test("the owner of a build: the bake's tenant, else the template ref's owner part", () => {
    expect(buildOwner("x.y", { kind: "oci", image: "i", tenantId: "ten_q" })).toBe("ten_q");
    expect(buildOwner("ten_r.tpl", { kind: "archive", path: "/p" })).toBe("ten_r");
    expect(buildOwner("python", { kind: "archive", path: "/p" })).toBe("");
  });

  test("deleting a template cancels its running build: its tool and the tool's children are killed", async () => {
    const dir = await scratchDir();
    const pidFile = join(dir, "child.pid");
    let toolDone: Promise<unknown> | undefined;
    const driver = {
      prepareTemplate(_id: string, _input: TemplateInput, signal: AbortSignal): Promise<PreparedTemplate> {
        // A build tool that starts a child of its own (as debootstrap and skopeo do).
        const run = runTool(["sh", "-c", `sleep 300 & echo $! > ${pidFile}; wait`], { signal });
        toolDone = run.catch((e) => e);
        return run.then(() => ({ image: {} as PreparedTemplate["image"], exposedPorts: [] }));
      },
      dropTemplate: async () => {},
      restoreTemplate: async () => {},
    } as unknown as SandboxDriver;
    const reg = new TemplateRegistry(driver, templateRecords(dir), () => {});
    reg.build("ten_c.slow", { kind: "archive", path: "/nonexistent" });
    await until(() => existsSync(pidFile) && readFileSync(pidFile, "utf8").trim() !== "");
    const child = Number((await readFile(pidFile, "utf8")).trim());
    expect(processGone(child)).toBe(false);
    await reg.delete("ten_c.slow", false);
    const err = (await toolDone) as { kind?: string };
    expect(err.kind).toBe("aborted");
    await until(() => processGone(child));
    await reg.settled("ten_c.slow");
    expect(reg.slotsByOwner()).toEqual({ running: {}, waiting: {} });
    expect(() => reg.status("ten_c.slow")).toThrow();
  });
});

/**
 * Two tenants' bakes through the registry with a driver that really pulls (agent/image/pull.ts)
 * from a private registry on loopback and stops before any VM: tenant B, who knows the digest of
 * tenant A's private image but not A's credentials, gets a Failed build whose error names a
 * stable code and an error id and nothing of the host; the agent's log has the full text.
 */
describe.skipIf(!existsSync(REGISTRY_BIN))("bakes of two tenants from a private registry", () => {
  const A = { username: "tenant-a", password: "a-only-secret" };
  let reg: LocalRegistry;
  let work: string;
  beforeAll(async () => {
    work = await mkdtemp(join(tmpdir(), "sbx-tpl-reg-"));
    reg = await startRegistry({ auth: A });
    const archive = join(work, "bb.tar");
    await makeOciArchive(archive, await busyboxImageSpec(work));
    await reg.push(`oci-archive:${archive}`, "a/private:1");
  }, 120_000);
  afterAll(async () => {
    await reg?.stop();
    if (work) await rm(work, { recursive: true, force: true });
  });

  test("B bakes A's digest and is refused; the error carries no host path; A's re-bake is cached", async () => {
    const cacheDir = join(work, "cache");
    const pulls: Array<{ id: string; cached: boolean; digest: string }> = [];
    const driver = {
      async prepareTemplate(
        id: string,
        input: TemplateInput,
        signal: AbortSignal,
      ): Promise<PreparedTemplate> {
        if (input.kind !== "oci") throw new Error("oci only");
        const p = await pullImage({
          reference: input.image,
          cacheDir,
          registry: { insecureRegistries: [] },
          signal,
          ...(input.registryAuth ? { auth: input.registryAuth } : {}),
        });
        pulls.push({ id, cached: p.cached, digest: p.digest });
        return { image: {} as PreparedTemplate["image"], exposedPorts: [] };
      },
      dropTemplate: async () => {},
      restoreTemplate: async () => {},
    } as unknown as SandboxDriver;
    const logs: string[] = [];
    const reg2 = new TemplateRegistry(driver, templateRecords(join(work, "records")), (m) => logs.push(m));
    const build = async (id: string, input: TemplateInput) => {
      reg2.build(id, input);
      await reg2.settled(id);
      return reg2.status(id);
    };
    const a = await build("tenant-a.app", {
      kind: "oci",
      image: `${reg.host}/a/private:1`,
      tenantId: "tenant-a",
      registryAuth: A,
    });
    expect(a.status).toBe("ready");
    const digest = pulls[0]!.digest;
    const blobs = (reg.log().match(/"GET \/v2\/a\/private\/blobs\//g) ?? []).length;

    const pinned = `${reg.host}/a/private@${digest}`;
    const b = await build("tenant-b.stolen", { kind: "oci", image: pinned, tenantId: "tenant-b" });
    expect(b).toMatchObject({ status: "failed", phase: "Failed" });
    expect(b.error).toMatch(
      /^registry_denied: looking up .* failed: the registry refused the credentials or access to the image \(error id err-[0-9a-f]{12}\)$/,
    );
    for (const leak of ["/tmp", "/var", work, cacheDir, "level=", "msg=", "time=", "skopeo"])
      expect(b.error).not.toContain(leak);
    expect(() => reg2.ready("tenant-b.stolen")).toThrow(/failed to build/);
    expect(pulls.map((p) => p.id)).toEqual(["tenant-a.app"]); // B's build never got a layout
    // The full text is in the agent's log, under the id the tenant was given.
    const errorId = /error id (err-[0-9a-f]+)/.exec(b.error ?? "")![1]!;
    const line = logs.find((l) => l.includes(errorId));
    expect(line).toContain("tenant-b");
    expect(line).toMatch(/unauthorized|authentication required/);

    const again = await build("tenant-a.app2", {
      kind: "oci",
      image: pinned,
      tenantId: "tenant-a",
      registryAuth: A,
    });
    expect(again.status).toBe("ready");
    expect(pulls.at(-1)).toMatchObject({ id: "tenant-a.app2", cached: true, digest });
    await reg.settled();
    expect((reg.log().match(/"GET \/v2\/a\/private\/blobs\//g) ?? []).length).toBe(blobs);
  }, 120_000);

  test("the egress fence refuses a loopback registry unless the operator allows its range", async () => {
    const pull = (fence: EgressFence) =>
      pullImage({
        reference: `${reg.host}/a/private:1`,
        cacheDir: join(work, "cache-fenced"),
        registry: { insecureRegistries: [], checkDestination: fencedRegistry(fence), fence },
        auth: A,
      });
    const before = reg.log().length;
    const refused = await pull(new EgressFence()).then(
      () => undefined,
      (e: SandboxdError) => e,
    );
    expect(refused?.details?.reason).toBe("registry_forbidden");
    expect(tenantErrorText(refused, "err-000000000000")).toBe(
      `registry_forbidden: looking up ${reg.host}/a/private:1 failed: the registry's address is not allowed (error id err-000000000000)`,
    );
    expect(reg.log().length).toBe(before); // nothing reached the registry
    const allowed = await pull(new EgressFence({ allowInternal: ["127.0.0.1/32"] }));
    expect(allowed.cached).toBe(false);
  }, 60_000);
});

describe("TemplateRegistry size classes (docs/templates.md#size-classes)", () => {
  const IMAGE = {
    env: [],
    workingDir: "/",
    entrypoint: [],
    cmd: ["sh"],
    user: { uid: 0, gid: 0, name: "root" },
    digest: "sha256:0",
    exposedPorts: [],
  };
  /** A driver that builds each class as the test lets it, noting every prepare, drop and restore. */
  function classDriver() {
    const h = heldDriver();
    const log: string[] = [];
    const driver = {
      ...h.driver,
      prepareTemplate: (
        id: string,
        input: TemplateInput,
        signal: AbortSignal,
        onPhase?: (p: BuildPhase) => void,
      ) => {
        log.push(`prepare ${id} ${input.size?.vcpus}x${input.size?.memMib}`);
        // An image config a record can hold (the held driver's is a bare stand-in).
        return h.driver.prepareTemplate(id, input, signal, onPhase).then((p) => ({ ...p, image: IMAGE }));
      },
      dropTemplate: async (id: string) => {
        log.push(`drop ${id}`);
      },
      restoreTemplate: async (id: string) => {
        log.push(`restore ${id}`);
      },
    } as unknown as SandboxDriver;
    return { driver, held: h.held, log };
  }
  const input: TemplateInput = { kind: "archive", path: "/nonexistent", size: { vcpus: 1, memMib: 128 } };
  const big = { vcpus: 2, memMib: 192 };

  test("every class is frozen in the build; a create names one; a restart restores them all", async () => {
    const dir = await scratchDir();
    const { driver, held, log } = classDriver();
    const reg = new TemplateRegistry(driver, templateRecords(dir), () => {});
    reg.build("t", input, { vcpus: 1, memMib: 128 }, [big]);
    await until(() => held.has("t"));
    held.get("t")!.finish();
    await until(() => held.has("t@2x192"));
    // Not ready until every class is.
    expect(reg.status("t").status).toBe("building");
    held.get("t@2x192")!.finish();
    await reg.settled("t");
    expect(log).toEqual(["prepare t 1x128", "prepare t@2x192 2x192"]);
    expect(reg.status("t").status).toBe("ready");
    expect(reg.ready("t").id).toBe("t");
    expect(reg.ready("t", { vcpus: 1, memMib: 128 }).id).toBe("t");
    expect(reg.ready("t", { vcpus: 2 })).toMatchObject({ id: "t@2x192", size: big });
    expect(() => reg.ready("t", { vcpus: 2, memMib: 128 })).toThrow(
      /has no size class of 2 vCPU and 128 MiB/,
    );

    const again = classDriver();
    const restarted = new TemplateRegistry(again.driver, templateRecords(dir), () => {});
    await restarted.load();
    expect(again.log).toEqual(["restore t", "restore t@2x192"]);
    expect(restarted.ready("t", { memMib: 192 }).id).toBe("t@2x192");
    expect(await restarted.delete("t", false)).toBe("deleted");
    expect(again.log.slice(2)).toEqual(["drop t", "drop t@2x192"]);
  });

  test("a class that fails fails the template, and the classes frozen before it are dropped", async () => {
    const { driver, held, log } = classDriver();
    const reg = new TemplateRegistry(driver, templateRecords(await scratchDir()), () => {});
    reg.build("u", input, { vcpus: 1, memMib: 128 }, [big]);
    await until(() => held.has("u"));
    held.get("u")!.finish();
    await until(() => held.has("u@2x192"));
    held.get("u@2x192")!.finish("no room for the second class");
    await reg.settled("u");
    const st = reg.status("u");
    expect(st.status).toBe("failed");
    expect(st.error).toContain("image_pull_failed");
    expect(log).toContain("drop u");
  });
});

/**
 * The template registry's bake phases (spec 3.2) as a build moves, with a driver that stands in
 * for the VM layer so each step is held until the test lets it go: Pending while queued behind
 * `MAX_CONCURRENT_BUILDS` builds, Converting, Distributing, Live; a failure is Failed with the
 * driver's reason. Real records on disk.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { SandboxdError } from "../../contracts/errors.ts";
import type { BuildPhase, PreparedTemplate, SandboxDriver, TemplateInput } from "./drivers/driver.ts";
import { templateRecords } from "./records.ts";
import { MAX_CONCURRENT_BUILDS, TemplateRegistry } from "./templates.ts";

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

async function until(cond: () => boolean): Promise<void> {
  for (let i = 0; i < 200 && !cond(); i++) await Bun.sleep(5);
  expect(cond()).toBe(true);
}

describe("TemplateRegistry phases", () => {
  test("Pending while queued, then Converting, Distributing, Live; a failure is Failed with its reason", async () => {
    const dir = await mkdtemp(join(tmpdir(), "sbx-tpl-"));
    dirs.push(dir);
    const { driver, held } = heldDriver();
    const reg = new TemplateRegistry(driver, templateRecords(dir), () => {});
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
    await until(() => held.has("q1"));
    await reg.delete("q2", false);
    held.get("q0")!.finish();
    held.get("q1")!.finish();
    await Bun.sleep(50);
    expect(held.has("q2")).toBe(false);
  });
});

import { afterAll, describe, expect, test } from "bun:test";
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { probeAccelerator } from "./accel.ts";

const dir = mkdtempSync(join(tmpdir(), "accel-test-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe("probeAccelerator", () => {
  test("SANDBOXD_ACCEL overrides the probe", async () => {
    expect(await probeAccelerator({ setting: "tcg" })).toEqual({
      accel: "tcg",
      reason: "SANDBOXD_ACCEL=tcg",
    });
    expect((await probeAccelerator({ setting: "kvm" })).accel).toBe("kvm");
  });

  test("no usable /dev/kvm means TCG", async () => {
    const r = await probeAccelerator({ devKvm: join(dir, "no-kvm") });
    expect(r.accel).toBe("tcg");
    expect(r.reason).toContain("cannot be opened read-write");
  });

  test("kvm_pvm alone (the CI hosts) means TCG, without booting anything", async () => {
    const kvm = join(dir, "kvm");
    writeFileSync(kvm, "");
    const mods = join(dir, "modules");
    writeFileSync(
      mods,
      "kvm_pvm 143360 0 - Live 0x0\nkvm 1138688 1 kvm_pvm, Live 0x0\next4 1 0 - Live 0x0\n",
    );
    const r = await probeAccelerator({ devKvm: kvm, procModules: mods });
    expect(r).toEqual({
      accel: "tcg",
      reason: "neither kvm_intel nor kvm_amd is loaded (kvm modules: kvm_pvm, kvm)",
    });
  });

  test("falls back to /sys/module when /proc/modules is hidden", async () => {
    const kvm = join(dir, "kvm2");
    writeFileSync(kvm, "");
    const sys = join(dir, "sysmodule");
    mkdirSync(join(sys, "kvm_pvm"), { recursive: true });
    const r = await probeAccelerator({
      devKvm: kvm,
      procModules: join(dir, "hidden"),
      sysModule: sys,
    });
    expect(r.reason).toContain("kvm_pvm");
  });

  test("the per-process result is cached", async () => {
    const a = probeAccelerator();
    expect(probeAccelerator()).toBe(a);
    const r = await a;
    expect(["kvm", "tcg"]).toContain(r.accel);
    expect(r.reason.length).toBeGreaterThan(0);
  });
});

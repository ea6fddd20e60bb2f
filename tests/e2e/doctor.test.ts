/** `sandboxd doctor` checks the real host: QEMU, tools, accelerator, space, guest artifacts. */
import { expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { HOST_KVM, hostKvmInitializes } from "../support/host-kvm.ts";

const REPO = resolve(import.meta.dir, "../..");
const DATA_DIR = process.env.SANDBOXD_TEST_DATA ?? join(REPO, ".data", "test");

function doctor(args: string[]) {
  return spawnSync(join(REPO, "bin/sandboxd"), ["doctor", ...args], { encoding: "utf8" });
}

test("a prepared host passes every check and names its accelerator", () => {
  // --build: the suite's data dir may be new (a fresh clone); building is idempotent.
  const r = doctor(["--build", "--data-dir", DATA_DIR]);
  expect(r.stdout).toMatch(/^ok {2}\s*accelerator\s+(kvm|tcg) \(/m);
  expect(r.stdout).toMatch(/^ok {2}\s*qemu\s+qemu-system-x86_64 \d+\.\d+/m);
  expect(r.stdout).toMatch(/^ok {2}\s*guest\s+kernel 6\.1\./m);
  // Where the host's KVM makes a `-cpu host` vCPU, a jailed QEMU must initialize KVM (even where
  // guests run under TCG); where even an unjailed QEMU aborts (some kvm_pvm hosts), doctor warns.
  if (hostKvmInitializes())
    expect(r.stdout).toMatch(/^ok {2}\s*jail: kvm\s+a jailed QEMU \(uid \d+\) initializes KVM/m);
  else if (existsSync(HOST_KVM))
    expect(r.stdout).toMatch(/^WARN\s+jail: kvm\s+a jailed QEMU cannot initialize KVM/m);
  // KSM: off by default, and guest RAM is never offered whatever the host runs.
  expect(r.stdout).toMatch(/^ok {2}\s*ksm\s+guest RAM never offered; QEMU's own memory not offered/m);
  expect(r.stdout).not.toContain("FAIL");
  expect(r.status).toBe(0);
}, 180_000);

test("missing guest artifacts fail with a fix, and nothing is built without --build", () => {
  const empty = mkdtempSync(join(tmpdir(), "doctor-"));
  try {
    const r = doctor(["--data-dir", empty]);
    expect(r.status).toBe(1);
    expect(r.stdout).toMatch(/^FAIL\s+guest\s/m);
    expect(r.stdout).toContain("fix: run `bin/sandboxd doctor --build`");
    expect(spawnSync("ls", [join(empty, "guest")], { encoding: "utf8" }).stdout.trim()).toBe("");
  } finally {
    rmSync(empty, { recursive: true, force: true });
  }
}, 60_000);

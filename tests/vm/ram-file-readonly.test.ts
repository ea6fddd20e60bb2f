/**
 * A RAM file other sandboxes start from is read-only to every jail (REAL VMs under TCG).
 *
 * A template's RAM file (and a fork point's) is mapped by each child privately
 * (`memory-backend-file,share=off`): QEMU opens it read-only (QEMU 7.2 would open it read-write;
 * the shim the jail preloads, agent/qemu/ram-readonly.c, makes that open read-only) and maps it
 * copy-on-write, the jail binds it read-only, and on the host it is root's, mode 0444. Shown from the host for a
 * template's child and a fork's child: the file's owner and mode; QEMU's handle on it is
 * O_RDONLY (/proc/PID/fdinfo) and its mapping private and never offered to KSM (/proc/PID/smaps
 * VmFlags: no `mg`, so a host running KSM cannot merge guest pages across tenants); a shell as the child's jail
 * uid inside its QEMU's mount namespace (what an escaped QEMU is) cannot open the file for
 * writing, while it can read it (the control); and the guest still writes its own memory.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { readdirSync, readFileSync, readlinkSync, statSync } from "node:fs";
import { rm } from "node:fs/promises";
import type { SandboxManager } from "../../agent/sandbox/manager.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import {
  managerWithBusybox,
  removeBusyboxArchive,
  shellIn,
  TEST_CACHE_DIR,
  tempStateDir,
} from "../support/real-vm.ts";

/** A template build, a spawn and a fork under TCG on a 2-core host. */
const VM_TEST_TIMEOUT_MS = 240_000;
const O_ACCMODE = 0o3;

let stateDir: string;
let m: SandboxManager;

beforeAll(async () => {
  stateDir = await tempStateDir();
  m = await managerWithBusybox({ stateDir, cacheDir: TEST_CACHE_DIR, memMib: 128 });
}, VM_TEST_TIMEOUT_MS);

afterAll(async () => {
  try {
    if (m) {
      for (const s of m.list()) await m.destroy(s.id, { force: true });
      await m.deleteTemplate("bb");
    }
  } finally {
    await rm(stateDir, { recursive: true, force: true });
    await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
    await removeBusyboxArchive();
  }
});

/**
 * The file backing QEMU's guest RAM: the one file mapping as large as the guest's memory, with
 * its flags from /proc/PID/smaps (`VmFlags`: `mg` is a mapping KSM may merge).
 */
function ramMapping(pid: number, memMib: number): { path: string; perms: string; vmFlags: string[] } {
  const want = memMib * 1024 * 1024;
  let found: { path: string; perms: string; vmFlags: string[] } | undefined;
  for (const line of readFileSync(`/proc/${pid}/smaps`, "utf8").split("\n")) {
    const m = /^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \d+\s+(\/\S+)$/.exec(line);
    if (m) {
      if (found) break; // the next mapping's header: the RAM's block ended without VmFlags
      if (Number.parseInt(m[2] as string, 16) - Number.parseInt(m[1] as string, 16) === want)
        found = { path: m[4] as string, perms: m[3] as string, vmFlags: [] };
    } else if (found && line.startsWith("VmFlags:")) {
      found.vmFlags = line.slice("VmFlags:".length).trim().split(/\s+/);
      return found;
    }
  }
  throw new Error(`QEMU ${pid} maps no ${memMib} MiB file (with its VmFlags)`);
}

/** Every handle `pid` holds on `path`: its number and access mode (from /proc/PID/fdinfo). */
function handlesOn(pid: number, path: string): { fd: number; access: number }[] {
  const out: { fd: number; access: number }[] = [];
  for (const fd of readdirSync(`/proc/${pid}/fd`)) {
    let target: string;
    try {
      target = readlinkSync(`/proc/${pid}/fd/${fd}`);
    } catch {
      continue; // closed between the listing and the read
    }
    if (target !== path) continue;
    const flags = /^flags:\s+([0-7]+)/m.exec(readFileSync(`/proc/${pid}/fdinfo/${fd}`, "utf8"));
    out.push({ fd: Number(fd), access: Number.parseInt(flags?.[1] ?? "-1", 8) & O_ACCMODE });
  }
  return out;
}

function uidOf(pid: number): number {
  return Number(/^Uid:\s+(\d+)/m.exec(readFileSync(`/proc/${pid}/status`, "utf8"))?.[1]);
}

/** `script` as the jail uid inside QEMU `pid`'s mount namespace: "ok" or the shell's error. */
async function asEscapedQemu(pid: number, script: string, inJail = true): Promise<string> {
  const uid = uidOf(pid);
  const p = Bun.spawn(
    [
      ...(inJail ? ["nsenter", `--target=${pid}`, "--mount", "--"] : []),
      "setpriv",
      `--reuid=${uid}`,
      `--regid=${uid}`,
      "--clear-groups",
      "--",
      "/bin/sh",
      "-c",
      script,
    ],
    { stdout: "pipe", stderr: "pipe" },
  );
  return (await p.exited) === 0 ? "ok" : (await new Response(p.stderr).text()).trim();
}

async function expectReadOnlyToItsJail(id: string): Promise<Record<string, unknown>> {
  const pid = m.info(id).qemuPid as number;
  const ram = ramMapping(pid, 128);
  const st = statSync(ram.path);
  const handles = handlesOn(pid, ram.path);
  const seen = {
    vm: id,
    ram: ram.path,
    owner: st.uid,
    mode: (st.mode & 0o7777).toString(8),
    mapping: ram.perms,
    vmFlags: ram.vmFlags.join(" "),
    handles: handles.map((h) => h.access),
    jailUid: uidOf(pid),
    write: await asEscapedQemu(pid, `exec 3>>'${ram.path}'`),
    overwrite: await asEscapedQemu(pid, `printf x | dd of='${ram.path}' conv=notrunc status=none`),
    chmod: await asEscapedQemu(pid, `chmod 666 '${ram.path}'`),
    // QEMU's own read-only handle reopened for writing through /proc by a process of its uid
    // (from the host's mount namespace, where /proc shows QEMU): the reopen checks the file's
    // mode again, so the handle cannot be upgraded.
    reopen: await asEscapedQemu(pid, `exec 3<>/proc/${pid}/fd/${handles[0]?.fd}`, false),
    read: await asEscapedQemu(pid, `head -c 4096 '${ram.path}' > /dev/null`),
    // The control for the reopen: the same handle reopened for reading works.
    reopenRead: await asEscapedQemu(pid, `exec 3</proc/${pid}/fd/${handles[0]?.fd}`, false),
  };
  console.log(`RAM_FILE ${JSON.stringify(seen)}`);
  expect(seen.jailUid).not.toBe(0);
  expect(seen.owner).toBe(0);
  expect(seen.mode).toBe("444");
  // Private (copy-on-write) and writable by the guest: its writes never reach the file.
  expect(seen.mapping).toBe("rw-p");
  // Never offered to KSM (`-M mem-merge=off`): on a host that runs it, merged guest pages would let
  // one tenant's guest time another's writes to the same content (a copy-on-write fault on a
  // shared page is slow), and share physical pages between tenants' guests.
  expect(ram.vmFlags).toContain("rd");
  expect(ram.vmFlags).not.toContain("mg");
  expect(seen.handles.length).toBeGreaterThan(0);
  expect(seen.handles.every((a) => a === 0)).toBe(true); // O_RDONLY
  for (const attempt of [seen.write, seen.overwrite, seen.chmod, seen.reopen]) expect(attempt).not.toBe("ok");
  expect(seen.reopen).toMatch(/Permission denied|Read-only file system/);
  expect(seen.write).toMatch(/Read-only file system|Permission denied/);
  expect(seen.read).toBe("ok");
  expect(seen.reopenRead).toBe("ok");
  return seen;
}

test(
  "a template's child and a fork's child: QEMU holds the shared RAM file read-only, and its uid cannot write it",
  async () => {
    const { vmId: parent } = await m.create("bb", { kind: "sandbox" });
    // The guest still writes its own memory (a private copy of the pages it touches).
    expect((await shellIn(m, parent, "echo written > /dev/shm/x && cat /dev/shm/x")).trim()).toBe("written");
    await expectReadOnlyToItsJail(parent);

    const [child] = await m.fork(parent, 1);
    const c = child?.vmId as string;
    expect((await shellIn(m, c, "cat /dev/shm/x && echo again > /dev/shm/x && cat /dev/shm/x")).trim()).toBe(
      "written\nagain",
    );
    // Its RAM file: the fork point's (shared fork mode) or the template's (the full state loaded
    // over it), read-only either way.
    await expectReadOnlyToItsJail(c);
    // The parent is untouched by its child's writes.
    expect((await shellIn(m, parent, "cat /dev/shm/x")).trim()).toBe("written");
  },
  VM_TEST_TIMEOUT_MS,
);

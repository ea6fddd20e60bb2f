/**
 * An ESCAPED QEMU cannot steer the root agent (snapshot driver, REAL VMs under TCG).
 *
 * A guest that broke out into its QEMU runs as that VM's jail uid. This test plays it from the
 * host: a shell as the jail uid (setpriv), started with its working directory already inside the
 * target directory (as the escaped QEMU sees its VM directory bound into its jail), writes
 * everything that uid can write: the VM's records (`snapshot-vm.json` rewritten to name a canary
 * directory as its id and canary files as its disk and RAM file, `owner.json` naming pid 1), the
 * chain store's table, a symlink at the console log and one at the QMP socket pointing at a
 * canary socket. Then the agent restarts (a new manager on the same state dir), A is deleted,
 * B is suspended and resumed, D (whose overlay's header names a canary file as its backing file)
 * is forked, then suspended and resumed, and C (whose QMP socket is a symlink) is looked at. The
 * canary directory outside the VM's files must be untouched (same names, content, mode and owner,
 * and the canary file never read: its atime stays), the canary socket never connected to, and
 * every VM works, or is `lost` or refused with a reason.
 */
import { afterAll, expect, test } from "bun:test";
import { existsSync, lstatSync, readdirSync, readFileSync, statSync, utimesSync } from "node:fs";
import { chmod, mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join, relative } from "node:path";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { SnapshotDriver } from "../../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import {
  managerWithBusybox,
  qemuPidsUnder,
  removeBusyboxArchive,
  shellIn,
  TEST_CACHE_DIR,
  tempStateDir,
} from "../support/real-vm.ts";

/** A template build, three restores, a restart and a suspend + resume under TCG: 240 s is ample. */
const VM_TEST_TIMEOUT_MS = 240_000;
const MEM_MIB = 256;

let stateDir: string | undefined;
let canary: string | undefined;
afterAll(async () => {
  if (stateDir) {
    for (const pid of await qemuPidsUnder(stateDir)) process.kill(pid, "SIGKILL");
    await rm(stateDir, { recursive: true, force: true });
    await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
  }
  if (canary) await rm(canary, { recursive: true, force: true });
  await removeBusyboxArchive();
});

/** Name, content, mode and owner of everything under `dir` (and of `dir` itself). */
function snapshotTree(dir: string): Record<string, string> {
  const out: Record<string, string> = {};
  const walk = (p: string) => {
    const st = lstatSync(p);
    const content = st.isFile() ? readFileSync(p, "utf8") : "";
    out[relative(dir, p) || "."] = `${st.mode.toString(8)} ${st.uid}:${st.gid} ${content}`;
    if (st.isDirectory()) for (const n of readdirSync(p)) walk(join(p, n));
  };
  walk(dir);
  return out;
}

/** The host uid the QEMU `pid` runs as (its jail's). */
function uidOf(pid: number): number {
  const line = readFileSync(`/proc/${pid}/status`, "utf8")
    .split("\n")
    .find((l) => l.startsWith("Uid:"));
  return Number(line?.split(/\s+/)[1]);
}

/**
 * Runs `script` as `uid` (no groups) with its working directory `cwd`, entered as root first:
 * the handle an escaped QEMU has on its VM directory. Answers "ok" or the shell's error.
 */
async function asJail(uid: number, cwd: string, script: string): Promise<string> {
  if (!existsSync(cwd)) return `no such directory ${cwd}`;
  const p = Bun.spawn(
    ["setpriv", `--reuid=${uid}`, `--regid=${uid}`, "--clear-groups", "--", "/bin/sh", "-c", script],
    { cwd, stdout: "pipe", stderr: "pipe" },
  );
  const code = await p.exited;
  return code === 0 ? "ok" : (await new Response(p.stderr).text()).trim();
}

/** Replaces `name` in `cwd` as `uid` with `text` (a new file renamed over the old one). */
function overwrite(uid: number, cwd: string, name: string, text: string): Promise<string> {
  const q = (s: string) => `'${s.replaceAll("'", "'\\''")}'`;
  return asJail(uid, cwd, `printf %s ${q(text)} > ${q(`${name}.x`)} && mv -f ${q(`${name}.x`)} ${q(name)}`);
}

/** Where a record of `vmId` may be: the VM directory, or the agent's records directory. */
function recordPlaces(sd: string, vmId: string): string[] {
  return [join(sd, "vms", vmId), join(sd, "records", "vms", vmId)];
}

/** The agent's current `snapshot-vm.json` of `vmId`, wherever this agent keeps it. */
async function agentRecord(sd: string, vmId: string): Promise<Record<string, unknown>> {
  for (const d of recordPlaces(sd, vmId).reverse()) {
    const p = join(d, "snapshot-vm.json");
    if (existsSync(p)) return JSON.parse(await readFile(p, "utf8")) as Record<string, unknown>;
  }
  throw new Error(`no record of ${vmId}`);
}

test(
  "an escaped QEMU's writes (records, chain table, owner, socket and log symlinks) touch nothing outside its VM after a restart, delete, suspend and resume",
  async () => {
    stateDir = await tempStateDir();
    const sd = stateDir;
    canary = await mkdtemp(join(tmpdir(), "sbx-canary-"));
    await chmod(canary, 0o755);
    await writeFile(join(canary, "file"), "canary file\n", { mode: 0o644 });
    await writeFile(join(canary, "mem"), "canary mem\n", { mode: 0o644 });
    const sockPath = join(canary, "sock");
    let canaryConnects = 0;
    const canarySock = Bun.listen({
      unix: sockPath,
      socket: {
        open: () => {
          canaryConnects++;
        },
        data: () => {},
      },
    });
    const before = snapshotTree(canary);
    // An atime before the mtime moves on any read of the file (relatime): it shows an open + read.
    const untouched = new Date("2001-01-01T00:00:00Z");
    utimesSync(join(canary, "file"), untouched, new Date());

    const m = await managerWithBusybox({ stateDir: sd, cacheDir: TEST_CACHE_DIR, memMib: MEM_MIB });
    const ids: string[] = [];
    for (let i = 0; i < 4; i++) ids.push((await m.create("bb", { kind: "sandbox" })).vmId);
    const [a, b, c, d] = ids as [string, string, string, string];
    const uids = Object.fromEntries(ids.map((id) => [id, uidOf(m.info(id).qemuPid as number)]));
    const recA = await agentRecord(sd, a);
    const recB = await agentRecord(sd, b);
    const recD = await agentRecord(sd, d);

    // ---- the escaped QEMU's writes ----
    const attempts: Record<string, string> = {};
    const vmDir = (id: string) => join(sd, "vms", id);
    const badA = { ...recA, vmId: relative(join(sd, "vms"), canary) };
    const badB = { ...recB, disk: join(canary, "file"), memPath: join(canary, "mem") };
    for (const [id, rec] of [
      [a, badA],
      [b, badB],
    ] as const) {
      for (const d of recordPlaces(sd, id)) {
        const uid = uids[id] as number;
        attempts[`${d}/snapshot-vm.json`] = await overwrite(uid, d, "snapshot-vm.json", JSON.stringify(rec));
        const owner = JSON.stringify({ ownerPid: 1, qemuPid: 1, jailUid: uid });
        attempts[`${d}/owner.json`] = await overwrite(uid, d, "owner.json", owner);
      }
    }
    attempts["storage/chain.json"] = await overwrite(
      uids[a] as number,
      join(sd, "storage"),
      "chain.json",
      JSON.stringify({
        version: 1,
        files: {
          [join(canary, "file")]: { path: join(canary, "file"), kind: "overlay", deps: [], holders: [] },
        },
      }),
    );
    attempts["A console.log"] = await asJail(
      uids[a] as number,
      vmDir(a),
      `rm -f console.log && ln -s ${join(canary, "file")} console.log`,
    );
    // The agent's own files in the VM directory (the jail's fstab and root) are not the jail's to
    // remove: the directory is root's, sticky.
    attempts["A jail.fstab"] = await asJail(uids[a] as number, vmDir(a), "rm -f jail.fstab");
    const dirStat = lstatSync(vmDir(a));
    const dirOwner = `${dirStat.uid}:${dirStat.gid} ${(dirStat.mode & 0o7777).toString(8)}`;
    attempts["C qmp.sock"] = await asJail(
      uids[c] as number,
      vmDir(c),
      `rm -f qmp.sock && ln -s ${sockPath} qmp.sock`,
    );
    // D's QEMU, in its own mount namespace (where its disk is bound), renames its overlay's
    // backing file in the qcow2 header to the canary: name at 4096, offset and length in the header.
    const name = join(canary, "file");
    const be = (n: number, bytes: number) =>
      Array.from(
        { length: bytes },
        (_, i) => `\\${((n >> (8 * (bytes - 1 - i))) & 0xff).toString(8).padStart(3, "0")}`,
      ).join("");
    const dd = (at: number) => `/usr/bin/dd of=${recD.disk} bs=1 seek=${at} conv=notrunc status=none`;
    const header = [
      `printf %s '${name}' | ${dd(4096)}`,
      `printf '${be(0, 4)}${be(4096, 4)}' | ${dd(8)}`,
      `printf '${be(name.length, 4)}' | ${dd(16)}`,
    ].join(" && ");
    const qemuD = m.info(d).qemuPid as number;
    const hdr = Bun.spawn(
      [
        "nsenter",
        `--target=${qemuD}`,
        "--mount",
        "--",
        "setpriv",
        `--reuid=${uids[d]}`,
        `--regid=${uids[d]}`,
        "--clear-groups",
        "--",
        "/usr/bin/sh",
        "-c",
        header,
      ],
      { stdout: "pipe", stderr: "pipe" },
    );
    attempts["D header"] = (await hdr.exited) === 0 ? "ok" : (await new Response(hdr.stderr).text()).trim();
    console.log(`ESCAPED_QEMU_WRITES ${JSON.stringify(attempts)}`);

    // ---- the agent restarts ----
    await m.detach();
    const artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });
    const driver = await SnapshotDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir: sd, artifacts });
    const m2 = await SandboxManager.open({ driver, stateDir: sd });
    const outcome: Record<string, string> = {};
    try {
      const states = Object.fromEntries(
        ids.map((id) => [id, `${m2.info(id).state} ${m2.info(id).reason ?? ""}`]),
      );
      console.log(`ESCAPED_QEMU_AFTER_RESTART ${JSON.stringify(states)}`);
      await m2.destroy(a, { force: true });
      outcome.a = m2.list().some((s) => s.id === a) ? "still listed" : "destroyed";
      try {
        if (m2.info(b).state === "running") {
          await m2.suspend(b);
          await m2.resume(b);
          outcome.b = `${m2.info(b).state} ${(await shellIn(m2, b, "echo up")).trim()}`;
        } else outcome.b = `${m2.info(b).state}: ${m2.info(b).reason ?? ""}`;
      } catch (err) {
        outcome.b = `failed: ${(err as Error).message}; state ${m2.info(b).state}: ${m2.info(b).reason ?? ""}`;
      }
      // A fork of D builds on its overlay: its header's backing name is held to the records.
      try {
        await m2.fork(d, 1);
        outcome.dFork = "forked";
      } catch (err) {
        outcome.dFork = `refused: ${(err as Error).message}; state ${m2.info(d).state}`;
      }
      try {
        await m2.suspend(d);
        await m2.resume(d);
        outcome.d = `${m2.info(d).state} ${(await shellIn(m2, d, "echo up")).trim()}`;
      } catch (err) {
        outcome.d = `failed: ${(err as Error).message}; state ${m2.info(d).state}`;
      }
      const infoC = m2.info(c);
      outcome.c =
        infoC.state === "running"
          ? `running ${(await shellIn(m2, c, "echo up")).trim()}`
          : `${infoC.state}: ${infoC.reason ?? ""}`;
      console.log(`ESCAPED_QEMU_OUTCOME ${JSON.stringify(outcome)}`);

      // Nothing outside the VMs' own files was touched, read or connected to.
      expect(statSync(join(canary, "file")).atimeMs).toBe(untouched.getTime());
      expect(snapshotTree(canary)).toEqual(before);
      expect(canaryConnects).toBe(0);
      // The records the agent reads back, and the chain table, were out of the jail uid's reach.
      for (const id of [a, b]) {
        const d = join(sd, "records", "vms", id);
        expect(attempts[`${d}/snapshot-vm.json`]).toContain("Permission denied");
        expect(attempts[`${d}/owner.json`]).toContain("Permission denied");
      }
      expect(attempts["storage/chain.json"]).toContain("Permission denied");
      expect(attempts["A jail.fstab"]).toContain("Operation not permitted");
      expect(dirOwner).toBe(`0:${uids[a]} 1770`);
      // Every VM works or is lost with a reason.
      expect(outcome.a).toBe("destroyed");
      expect(outcome.b).toBe("running up");
      expect(outcome.c).toMatch(/^(running up|lost: .+)$/);
      expect(existsSync(vmDir(a))).toBe(false);
      // D's header named a file its records do not: its jail was not built around it.
      expect(attempts["D header"]).toBe("ok");
      expect(outcome.d).toContain(`image headers name ${name}, which its records do not`);
      // Its fork was refused with that reason, before anything was made on the overlay.
      expect(outcome.dFork).toContain(`image headers name ${name}, which its records do not`);
      expect(outcome.dFork).toContain("refusing to fork");
    } finally {
      for (const s of m2.list()) await m2.destroy(s.id, { force: true });
      canarySock.stop(true);
    }
    expect(await qemuPidsUnder(sd)).toEqual([]);
    expect(existsSync(dirname(sockPath))).toBe(true);
  },
  VM_TEST_TIMEOUT_MS,
);

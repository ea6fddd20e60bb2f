/**
 * KVM in the jail (agent/qemu/jail.ts, jail-setup.ts), checked from the host with a real jailed
 * QEMU under `-accel kvm`, started paused (a stock guest cannot boot on every KVM host, as on
 * kvm_pvm; initializing KVM is what the jail must allow): QMP says KVM is present and enabled, and
 * /proc says QEMU runs as the VM's own uid, with no groups, holding the jail's own /dev/kvm node
 * open; that node (the host's device number, the VM's uid, mode 0600) is the jail's only device
 * mount from the jail's root, the host's node is left as it was, and the node goes with the VM.
 * `sandboxd doctor`'s probe (probeJailedKvm) says the same.
 *
 * Only where the host's KVM initializes the vCPU our KVM VMs use (`-cpu host`) outside any jail:
 * on some kvm_pvm hosts (an AMD EPYC one here) QEMU itself aborts setting MSR 0x10a
 * (IA32_ARCH_CAPABILITIES), jail or not, and there is nothing for the jail to grant.
 */
import { afterAll, describe, expect, test } from "bun:test";
import { existsSync, lstatSync, mkdirSync, readdirSync, readFileSync, readlinkSync, statSync } from "node:fs";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { probeJailedKvm } from "../../agent/qemu/accel.ts";
import { jailRoot } from "../../agent/qemu/jail.ts";
import { launchVm, type VmProcess } from "../../agent/qemu/launch.ts";
import { HOST_KVM, hostKvmInitializes } from "../support/host-kvm.ts";
import { TEST_CACHE_DIR, tempStateDir } from "../support/real-vm.ts";

/** A paused QEMU starts in well under a second; the guest artifacts may need a first build. */
const KVM_TEST_TIMEOUT_MS = 120_000;

const KVM_USABLE = hostKvmInitializes();
let stateDir: string | undefined;
let vm: VmProcess | undefined;

afterAll(async () => {
  await vm?.kill();
  if (stateDir) await rm(stateDir, { recursive: true, force: true });
});

function statusOf(pid: number): Record<string, string> {
  const out: Record<string, string> = {};
  for (const line of readFileSync(`/proc/${pid}/status`, "utf8").split("\n")) {
    const i = line.indexOf(":");
    if (i > 0) out[line.slice(0, i)] = line.slice(i + 1).trim();
  }
  return out;
}

describe("KVM in the jail", () => {
  test.skipIf(!KVM_USABLE)(
    "a jailed QEMU initializes KVM through the jail's own /dev/kvm, as the VM's uid",
    async () => {
      const host = statSync(HOST_KVM);
      const hostBefore = { mode: host.mode, uid: host.uid, gid: host.gid };
      stateDir = await tempStateDir();
      const dir = join(stateDir, "vm-kvm");
      mkdirSync(dir);
      const artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });
      const v = await launchVm({ dir, artifacts, memMib: 128, vcpus: 1, accel: "kvm", paused: true });
      vm = v;
      const uid = v.jailUid as number;
      expect(uid).toBeGreaterThan(0);

      // QEMU itself: KVM is there and in use.
      expect(await v.qmp.execute("query-kvm")).toEqual({ enabled: true, present: true });
      expect(await v.qmp.execute("query-status")).toMatchObject({ running: false });

      // From the host: QEMU runs as the VM's uid and gid, with no supplementary groups (a host
      // node of mode 0660 root:kvm could not be opened through a group).
      const st = statusOf(v.pid);
      expect(st.Uid?.split(/\s+/)).toEqual([`${uid}`, `${uid}`, `${uid}`, `${uid}`]);
      expect(st.Gid?.split(/\s+/)).toEqual([`${uid}`, `${uid}`, `${uid}`, `${uid}`]);
      expect(st.Groups).toBe("");

      // ... and holds a KVM device open: an fd named /dev/kvm, of the host node's device number.
      const fds = readdirSync(`/proc/${v.pid}/fd`).map((fd) => ({
        fd,
        link: readlinkSync(`/proc/${v.pid}/fd/${fd}`),
      }));
      const kvmFds = fds.filter((f) => f.link === HOST_KVM);
      expect(kvmFds.length).toBeGreaterThan(0);
      for (const f of kvmFds) {
        const s = statSync(`/proc/${v.pid}/fd/${f.fd}`);
        expect(s.isCharacterDevice()).toBe(true);
        expect(s.rdev).toBe(host.rdev);
        // The jail's node, not the host's: owned by the VM's uid.
        expect(s.uid).toBe(uid);
      }

      // The node in the jail's root on disk: the host's device number, the VM's uid, mode 0600.
      const node = jailRoot(dir) + HOST_KVM;
      const n = lstatSync(node);
      expect(n.isCharacterDevice()).toBe(true);
      expect(n.rdev).toBe(host.rdev);
      expect([n.uid, n.gid, n.mode & 0o7777]).toEqual([uid, uid, 0o600]);

      // The jail's mounts, from the host: /dev/kvm is that node bound onto itself, the one mount
      // from the jail's root without nodev; no mount reaches the host's devtmpfs kvm node.
      const mounts = readFileSync(`/proc/${v.pid}/mountinfo`, "utf8")
        .trim()
        .split("\n")
        .map((l) => {
          const [pre = "", post = ""] = l.split(" - ");
          const f = pre.split(" ");
          return { root: f[3] ?? "", point: f[4] ?? "", opts: f[5] ?? "", fstype: post.split(" ")[0] ?? "" };
        });
      const kvmMount = mounts.filter((m) => m.point === HOST_KVM);
      expect(kvmMount).toHaveLength(1);
      expect(kvmMount[0]?.root).toEndWith(`${dir}/root/dev/kvm`);
      expect(kvmMount[0]?.opts.split(",")).not.toContain("nodev");
      expect(mounts.filter((m) => m.fstype === "devtmpfs" && m.root === "/kvm")).toEqual([]);

      // The host's node is as it was: the jail never changes it.
      const after = statSync(HOST_KVM);
      expect({ mode: after.mode, uid: after.uid, gid: after.gid }).toEqual(hostBefore);

      // The node goes with the QEMU that used it.
      await v.kill();
      vm = undefined;
      expect(existsSync(node)).toBe(false);
    },
    KVM_TEST_TIMEOUT_MS,
  );

  test.skipIf(!KVM_USABLE)(
    "doctor's probe: a jailed QEMU initializes KVM on this host, and leaves nothing behind",
    async () => {
      const artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });
      const probeDirs = () => readdirSync("/tmp").filter((n) => n.startsWith("sbx-kvm-probe-"));
      const before = probeDirs();
      const r = await probeJailedKvm(artifacts);
      expect(r).toMatchObject({ ok: true });
      expect(r.detail).toContain("initializes KVM (query-kvm: present, enabled)");
      expect(probeDirs().filter((n) => !before.includes(n))).toEqual([]);
    },
    KVM_TEST_TIMEOUT_MS,
  );
});

/**
 * Egress with REAL VMs under TCG (spec 2.5 `egress.allow`, docs/decisions.md "Egress"): the guest
 * has no network interface; busybox wget inside it goes through the guest agent's proxy port,
 * whose connections reach the host agent as guest-opened tunnels and are checked there by name.
 * Servers on host loopback addresses stand in for an allowed (127.0.0.2) and a denied
 * (127.0.0.3) host; an unresolvable name shows that refusal needs no DNS.
 */
import { afterAll, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { rm } from "node:fs/promises";
import { createServer, type Server } from "node:net";
import { resolve } from "node:path";
import { ensureGuestArtifacts } from "../agent/guest/artifacts.ts";
import { SnapshotDriver } from "../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../agent/sandbox/manager.ts";
import {
  busyboxArchive,
  leftovers,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
} from "../agent/sandbox/testing.ts";
import { ownerFileOf } from "../agent/snapshot/shm.ts";
import { defaultShmRoot } from "../agent/snapshot/template.ts";
import type { SandboxdError } from "../contracts/errors.ts";

/** A template build, two spawns and a fork under TCG on a 2-core host: 240 s with margin. */
const VM_TEST_TIMEOUT_MS = 240_000;

afterAll(removeBusyboxArchive);

function listen(host: string, onConn: () => void, body: string): Promise<Server> {
  const s = createServer((sock) => {
    onConn();
    sock.once("data", () =>
      sock.end(`HTTP/1.1 200 OK\r\nContent-Length: ${body.length}\r\nConnection: close\r\n\r\n${body}`),
    );
  });
  return new Promise((resolve) => s.listen(0, host, () => resolve(s)));
}
const portOf = (s: Server) => (s.address() as { port: number }).port;

test(
  "allowed host reached through the guest's proxy; denied and unknown hosts refused at once and logged; no other route; default deny; forks keep the list",
  async () => {
    let allowedHits = 0;
    let deniedHits = 0;
    const allowed = await listen("127.0.0.2", () => allowedHits++, "egress-ok");
    const denied = await listen("127.0.0.3", () => deniedHits++, "must-not-see");
    const stateDir = await tempStateDir();
    const logs: string[] = [];
    const artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });
    const driver = await SnapshotDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir, artifacts });
    const manager = await SandboxManager.open({ driver, stateDir, log: (m) => logs.push(m) });
    // The tmpfs root of RAM files names its data dir (agent/snapshot/shm.ts), also after the
    // start-up sweep of unregistered files: an `rm -rf` of the data dir lets a later agent free it.
    expect(readFileSync(ownerFileOf(defaultShmRoot(stateDir)), "utf8")).toBe(resolve(stateDir));
    const sh = (id: string, command: string) =>
      manager.exec(id, { files: [], run: { kind: "shell", command }, timeoutMs: 30_000 });
    const A = `http://127.0.0.2:${portOf(allowed)}/hello`;
    const B = `http://127.0.0.3:${portOf(denied)}/`;
    try {
      manager.buildTemplate("busybox", { kind: "archive", path: await busyboxArchive() });
      await manager.templates.settled("busybox");

      // A malformed allow-list is refused before anything starts.
      let bad: unknown;
      try {
        await manager.create("busybox", { kind: "sandbox", egressAllow: ["http://x.com"] });
      } catch (err) {
        bad = err;
      }
      expect((bad as SandboxdError).code).toBe("bad_request");

      const vm = await manager.create("busybox", {
        kind: "sandbox",
        egressAllow: ["127.0.0.2", "*.allowed.test"],
      });
      const id = vm.vmId;

      const ok = await sh(id, `wget -q -O - ${A}`);
      expect(ok.stdout).toBe("egress-ok");
      expect(ok.exitCode).toBe(0);
      expect(allowedHits).toBe(1);

      // Denied by name (an IP no entry names; a name nobody can resolve): refused at once.
      for (const url of [B, "http://blocked.example/", "http://allowed.test/"]) {
        const t0 = performance.now();
        const r = await sh(id, `wget -q -O - ${url}; echo "rc=$?"`);
        expect(r.stdout).toContain("rc=1");
        expect(performance.now() - t0).toBeLessThan(3_000);
      }
      expect(deniedHits).toBe(0);
      const refused = manager.info(id).egressRefused.map((a) => a.host);
      expect(refused).toEqual(["127.0.0.3", "blocked.example", "allowed.test"]);
      expect(logs.some((l) => l.includes(`egress denied: sandbox ${id} -> 127.0.0.3`))).toBe(true);

      // No other way out: without the proxy there is no route, and the failure is immediate.
      const t0 = performance.now();
      const direct = await sh(id, `env -u http_proxy -u HTTP_PROXY wget -q -T 5 -O - ${A}; echo "rc=$?"`);
      expect(direct.stdout).toContain("rc=1");
      const raw = await sh(id, "nc -w 5 10.1.2.3 80 </dev/null; echo rc=$?");
      expect(raw.stdout).toContain("rc=1");
      expect(performance.now() - t0).toBeLessThan(4_000);
      expect(allowedHits).toBe(1);

      // The sandbox's own loopback stays inside it, whatever the list: busybox wget ignores
      // no_proxy, so its request comes to the proxy and is routed back into the guest.
      const local = await sh(
        id,
        "mkdir -p /www && echo inside > /www/x && httpd -p 127.0.0.1:8080 -h /www && wget -q -O - http://127.0.0.1:8080/x && wget -q -O - http://localhost:8080/x",
      );
      expect(local.stdout).toBe("inside\ninside\n");

      // A fork child keeps its parent's list.
      const [child] = await manager.fork(id, 1);
      expect((await sh(child!.vmId, `wget -q -O - ${A}`)).stdout).toBe("egress-ok");
      expect((await sh(child!.vmId, `wget -q -O - ${B}; echo "rc=$?"`)).stdout).toContain("rc=1");
      expect(manager.info(child!.vmId).egressAllow).toEqual(["127.0.0.2", "*.allowed.test"]);

      // No `egress`: the deployment default, deny.
      const plain = await manager.create("busybox", { kind: "sandbox" });
      expect(manager.info(plain.vmId).egressAllow).toEqual([]);
      expect((await sh(plain.vmId, `wget -q -O - ${A}; echo "rc=$?"`)).stdout).toContain("rc=1");
      expect(allowedHits).toBe(2);
      expect(deniedHits).toBe(0);
    } finally {
      for (const s of manager.list()) await manager.destroy(s.id, { force: true });
      await manager.deleteTemplate("busybox").catch(() => {});
      const left = await leftovers(stateDir);
      await rm(stateDir, { recursive: true, force: true });
      await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
      allowed.close();
      denied.close();
      expect(left).toEqual({ qemus: [], vmDirs: [] });
    }
  },
  VM_TEST_TIMEOUT_MS,
);

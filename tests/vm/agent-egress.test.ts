/**
 * Egress with REAL VMs under TCG (docs/sandboxes.md "Rules of the sandboxes API" `egress.allow`, docs/egress.md "Egress: choices"): the guest
 * has no network interface; busybox wget inside it goes through the guest agent's proxy port,
 * whose connections reach the host agent as guest-opened tunnels and are checked there by name,
 * then by the operator's fence. Servers on host loopback addresses stand in for an allowed
 * (127.0.0.5, reachable because the operator's range names it) and a denied (127.0.0.3) host; an
 * unresolvable name shows that refusal needs no DNS. Canaries on 127.0.0.1 and 127.0.0.2 count
 * what every bypass of the fence reaches on the host: nothing. Names resolve through a stub given
 * in the agent's options (no DNS, no /etc/hosts).
 */
import { afterAll, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { rm } from "node:fs/promises";
import { createServer, type Server } from "node:net";
import { resolve } from "node:path";
import { EgressFence } from "../../agent/egress/fence.ts";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { SnapshotDriver } from "../../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { ownerFileOf } from "../../agent/snapshot/shm.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import type { SandboxdError } from "../../contracts/errors.ts";
import {
  busyboxArchive,
  leftovers,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
} from "../support/real-vm.ts";

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

/** What a name resolves to, for the fence: only these names exist. */
const NAMES: Record<string, string[]> = {
  "ok.allowed.test": ["127.0.0.5"],
  "loop.allowed.test": ["127.0.0.1"],
  "mixed.allowed.test": ["203.0.113.7", "127.0.0.1"],
};

test(
  "allowed host reached through the guest's proxy; denied and unknown hosts refused at once and logged; no other route; default deny; forks keep the list; no bypass of the operator's fence reaches the host",
  async () => {
    let allowedHits = 0;
    let deniedHits = 0;
    let canaryHits = 0;
    const allowed = await listen("127.0.0.5", () => allowedHits++, "egress-ok");
    const denied = await listen("127.0.0.3", () => deniedHits++, "must-not-see");
    const canary1 = await listen("127.0.0.1", () => canaryHits++, "canary");
    const canary2 = await listen("127.0.0.2", () => canaryHits++, "canary");
    const stateDir = await tempStateDir();
    const logs: string[] = [];
    const artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });
    const driver = await SnapshotDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir, artifacts });
    // The operator opens one loopback address for the allowed stand-in; no tenant entry can.
    const fence = new EgressFence({
      allowInternal: ["127.0.0.5/32"],
      resolve: async (name) => {
        const a = NAMES[name];
        if (!a) throw new Error(`${name}: no such name`);
        return a;
      },
    });
    const manager = await SandboxManager.open({ driver, stateDir, log: (m) => logs.push(m), fence });
    // The tmpfs root of RAM files names its data dir (agent/snapshot/shm.ts), also after the
    // start-up sweep of unregistered files: an `rm -rf` of the data dir lets a later agent free it.
    expect(readFileSync(ownerFileOf(defaultShmRoot(stateDir)), "utf8")).toBe(resolve(stateDir));
    const sh = (id: string, command: string) =>
      manager.exec(id, { files: [], run: { kind: "shell", command }, timeoutMs: 30_000 });
    const A = `http://127.0.0.5:${portOf(allowed)}/hello`;
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
        egressAllow: ["127.0.0.5", "*.allowed.test"],
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
        // Only catches a hang (the exec's own 30 s timeout) instead of the proxy's refusal.
        expect(performance.now() - t0).toBeLessThan(20_000);
      }
      expect(deniedHits).toBe(0);
      const refused = manager.info(id).egressRefused.map((a) => a.host);
      expect(refused).toEqual(["127.0.0.3", "blocked.example", "allowed.test"]);
      expect(logs.some((l) => l.includes(`egress denied: sandbox ${id} -> 127.0.0.3`))).toBe(true);

      // No other way out: without the proxy there is no route, and the failure is immediate.
      const t0 = performance.now();
      // (No -T: this busybox's wget crashes with it, which once made the check pass vacuously.)
      const direct = await sh(id, `env -u http_proxy -u HTTP_PROXY wget -q -O - ${A}; echo "rc=$?"`);
      expect(direct.stdout).toContain("rc=1");
      const raw = await sh(id, "nc -w 25 10.1.2.3 80 </dev/null; echo rc=$?");
      expect(raw.stdout).toContain("rc=1");
      // Only catches a connection that waits (for nc's 25 s, or the exec's 30 s) instead of failing.
      expect(performance.now() - t0).toBeLessThan(20_000);
      expect(allowedHits).toBe(1);

      // The sandbox's own loopback stays inside it, whatever the list: busybox wget ignores
      // no_proxy, so its request comes to the proxy and is routed back into the guest.
      // Ten times through the proxy: a clean close from the guest once made the proxy's Node
      // Duplex drop a reply it had not read yet (3-13 in 40 such requests cut short).
      const local = await sh(
        id,
        "mkdir -p /www && echo inside > /www/x && httpd -p 127.0.0.1:8080 -h /www && wget -q -O - http://127.0.0.1:8080/x && for i in 1 2 3 4 5 6 7 8 9 10; do wget -q -O - http://localhost:8080/x || echo failed; done",
      );
      expect(local.stdout).toBe("inside\n".repeat(11));

      // A fork child keeps its parent's list.
      const [child] = await manager.fork(id, 1);
      expect((await sh(child!.vmId, `wget -q -O - ${A}`)).stdout).toBe("egress-ok");
      expect((await sh(child!.vmId, `wget -q -O - ${B}; echo "rc=$?"`)).stdout).toContain("rc=1");
      expect(manager.info(child!.vmId).egressAllow).toEqual(["127.0.0.5", "*.allowed.test"]);

      // No `egress`: the deployment default, deny.
      const plain = await manager.create("busybox", { kind: "sandbox" });
      expect(manager.info(plain.vmId).egressAllow).toEqual([]);
      expect((await sh(plain.vmId, `wget -q -O - ${A}; echo "rc=$?"`)).stdout).toContain("rc=1");
      expect(allowedHits).toBe(2);
      expect(deniedHits).toBe(0);

      // The operator's range reached by name too: the fence connects to the address it checked.
      expect((await sh(id, `wget -q -O - http://ok.allowed.test:${portOf(allowed)}/`)).stdout).toBe(
        "egress-ok",
      );
      expect(allowedHits).toBe(3);

      // Bypasses of the fence, listed exactly by the tenant or under `*`: each is a 403 at once
      // (timed inside the guest) and the canaries on host loopback see nothing.
      const P1 = portOf(canary1);
      const P2 = portOf(canary2);
      const get = (host: string) => `GET http://${host}/ HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n`;
      const connect = (hp: string) => `CONNECT ${hp} HTTP/1.1\\r\\n\\r\\n`;
      const bypass = async (allow: string[], requests: string[]) => {
        const sb = await manager.create("busybox", { kind: "sandbox", egressAllow: allow });
        // The guest's tunnels have no half-close, so the request is fed through a FIFO held open
        // past the answer (nc exits when the proxy closes); `time` measures nc alone. A proxy that
        // kept the connection open would hold nc for the 20 s its input stays open (and its -w):
        // under 10 s is the proxy's close, with room for a loaded host.
        const script = requests
          .map(
            (r, i) =>
              `printf '${r}' > /tmp/r${i}; mkfifo /tmp/f${i}; (cat /tmp/r${i}; sleep 20) > /tmp/f${i} 2>/dev/null &\n` +
              `echo "== ${i}"; busybox time -f "t=%e" nc -w 20 127.0.0.1 \${http_proxy##*:} < /tmp/f${i} 2>/tmp/t${i} | tr -d "\\r" | grep -E "^(HTTP|X-Sandboxd)"; cat /tmp/t${i}`,
          )
          .join("\n");
        const out = (await sh(sb.vmId, `mkdir -p /tmp\n${script}`)).stdout;
        const blocks = out.split(/^== \d+\n/m).slice(1);
        expect(blocks).toHaveLength(requests.length);
        for (const [i, b] of blocks.entries()) {
          const at = { request: requests[i], b };
          expect(at.b).toContain("HTTP/1.1 403 Forbidden\nX-Sandboxd-Egress: denied\n");
          const t = Number(/^t=([\d.]+)$/m.exec(b)?.[1]);
          expect({ ...at, t: t < 10 }).toEqual({ ...at, t: true });
        }
        return sb.vmId;
      };
      const exact = await bypass(
        ["0.0.0.0", "127.0.0.2", "::ffff:127.0.0.1"],
        [
          get(`0.0.0.0:${P1}`),
          get(`127.0.0.2:${P2}`),
          connect(`[::ffff:127.0.0.1]:${P1}`),
          get(`[::ffff:127.0.0.1]:${P1}`),
        ],
      );
      const star = await bypass(
        ["*"],
        [
          connect(`[::ffff:7f00:1]:${P1}`),
          connect(`2130706433:${P1}`),
          get(`2130706433:${P1}`),
          connect(`127.1:${P1}`),
          get(`127.1:${P1}`),
          get(`0x7f.1:${P1}`),
          connect(`0177.0.0.2:${P2}`),
          connect(`[::127.0.0.1]:${P1}`),
          connect(`0:${P1}`),
          connect(`loop.allowed.test:${P1}`),
          get(`mixed.allowed.test:${P1}`),
        ],
      );
      // The tenant's list cannot name loopback for the fence either: a wildcard name that
      // resolves there is refused too.
      const viaName = await sh(id, `wget -q -O - http://loop.allowed.test:${P1}/; echo "rc=$?"`);
      expect(viaName.stdout).toContain("rc=1");
      expect(canaryHits).toBe(0);
      // Kept in the refusal list with the fence's reason, and logged.
      const refusedExact = manager.info(exact).egressRefused;
      expect(refusedExact.map((a) => a.host)).toEqual([
        "0.0.0.0",
        "127.0.0.2",
        "::ffff:127.0.0.1",
        "::ffff:127.0.0.1",
      ]);
      expect(refusedExact.every((a) => /internal/.test(a.reason ?? ""))).toBe(true);
      const refusedStar = manager.info(star).egressRefused.map((a) => a.host);
      expect(refusedStar).toEqual([
        "::ffff:7f00:1",
        "2130706433",
        "2130706433",
        "127.1",
        "127.1",
        "0x7f.1",
        "0177.0.0.2",
        "::127.0.0.1",
        "0",
        "loop.allowed.test",
        "mixed.allowed.test",
      ]);
      expect(
        logs.some((l) => l.includes(`egress denied: sandbox ${star} -> mixed.allowed.test:${P1} (`)),
      ).toBe(true);
      expect(allowedHits).toBe(3);
    } finally {
      for (const s of manager.list()) await manager.destroy(s.id, { force: true });
      await manager.deleteTemplate("busybox").catch(() => {});
      const left = await leftovers(stateDir);
      await rm(stateDir, { recursive: true, force: true });
      await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
      allowed.close();
      denied.close();
      canary1.close();
      canary2.close();
      expect(left).toEqual({ qemus: [], vmDirs: [] });
    }
  },
  VM_TEST_TIMEOUT_MS,
);

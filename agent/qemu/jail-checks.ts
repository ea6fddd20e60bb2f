/**
 * Each ingredient of the jail (jail.ts) checked on this host, for `doctor`: what is missing and
 * how to fix it. The agent builds every jail as root; a VM whose jail cannot be built does not
 * start.
 */
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { CGROUP_ROOT, cgroupVersion, missingControllers } from "./cgroup.ts";
import { JAIL_ENV, PIVOT_ROOT, SETPRIV, sandboxOption, UNSHARE_FLAGS } from "./jail.ts";
import { DEFAULT_JAIL, type JailSettings } from "./jail-setup.ts";
import { QEMU_BINARY_PATH } from "./launch.ts";
import { rangeClashes, subidOverlaps } from "./uids.ts";

export interface JailCheck {
  name: string;
  ok: boolean;
  detail: string;
  fix?: string;
}

function run(argv: string[]): { ok: boolean; out: string } {
  const [cmd, ...args] = argv as [string, ...string[]];
  const r = spawnSync(cmd, args, { encoding: "utf8", timeout: 10_000, env: { ...JAIL_ENV } });
  return { ok: r.status === 0, out: `${r.stdout ?? ""}${r.stderr ?? ""}`.trim() };
}

export function jailChecks(settings: JailSettings = DEFAULT_JAIL): JailCheck[] {
  const out: JailCheck[] = [];
  const root = process.getuid?.() === 0;
  out.push({
    name: "jail: root",
    ok: root,
    detail: root ? "the agent runs as root (it builds each VM's jail)" : "not root: jails cannot be built",
    fix: "run the agent as root: it makes namespaces, mounts, cgroups and drops each QEMU to its own uid",
  });
  const unshare = settings.unshare;
  for (const [path, what] of [
    [unshare, "unshare"],
    [SETPRIV, "setpriv"],
    [PIVOT_ROOT, "pivot_root"],
  ] as const) {
    out.push({
      name: `jail: ${what}`,
      ok: existsSync(path),
      detail: existsSync(path) ? path : `${path} not found`,
      fix: "apt-get install util-linux",
    });
  }
  if (root && existsSync(unshare)) {
    const r = run([unshare, ...UNSHARE_FLAGS, "true"]);
    out.push({
      name: "jail: namespaces",
      ok: r.ok,
      detail: r.ok ? "mount, pid, ipc, uts and net namespaces can be made" : r.out,
      fix: "allow namespaces for root (a container runtime may forbid unshare: run the agent on the host)",
    });
  }
  const range = settings.uidRange;
  const clashes = [...rangeClashes(range), ...subidOverlaps(range)];
  out.push({
    name: "jail: uids",
    ok: range.count > 0 && range.base > 0 && clashes.length === 0,
    detail:
      range.count <= 0
        ? "the uid range is empty"
        : clashes.length
          ? `the uid range ${range.base}+${range.count} holds real users or their subordinate ids: ${clashes.slice(0, 3).join("; ")}`
          : `one uid per VM from ${range.base}..${range.base + range.count - 1}, no real user in it`,
    fix: "set SANDBOXD_JAIL_UID_BASE / SANDBOXD_JAIL_UID_COUNT to a range no user or group holds",
  });
  const v = cgroupVersion();
  const missing = v === undefined ? ["memory", "pids", "cpu"] : missingControllers();
  out.push({
    name: "jail: cgroups",
    ok: v !== undefined && missing.length === 0,
    detail:
      v === undefined
        ? `no cgroup hierarchy under ${CGROUP_ROOT}`
        : missing.length
          ? `cgroup v${v}: missing ${missing.join(", ")}`
          : `cgroup v${v} with memory, pids and cpu`,
    fix:
      v === 2
        ? "enable the controllers: echo '+memory +pids +cpu' > /sys/fs/cgroup/cgroup.subtree_control"
        : "mount the cgroup hierarchies (v2: mount -t cgroup2 none /sys/fs/cgroup)",
  });
  const sb = run([QEMU_BINARY_PATH, "-sandbox", sandboxOption(), "-version"]);
  out.push({
    name: "jail: seccomp",
    ok: sb.ok,
    detail: sb.ok ? `QEMU accepts -sandbox ${sandboxOption()}` : (sb.out.split("\n").at(-1) ?? ""),
    fix: "install a QEMU built with seccomp (Debian's qemu-system-x86 is)",
  });
  return out;
}

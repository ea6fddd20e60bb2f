/** The readable form of a benchmark result (`sandboxd bench` without --json). */
import type { BenchResult, Target } from "./engine-result.ts";
import type { Summary } from "./stats.ts";

function stats(s: Summary, unit: string): string {
  return `p50 ${s.p50} ${unit}, p95 ${s.p95} ${unit} (n=${s.n})`;
}

function goal(t: Target | undefined, op: string, unit: string): string {
  if (!t) return "";
  return `${op} ${t.limit}${unit}  ${t.pass ? "PASS" : "FAIL"}`;
}

export function formatTable(r: BenchResult): string {
  const m = r.host_memory_per_idle_vm_mb;
  const t = r.targets;
  const p = r.restore_in_place_parts_ms;
  const rows: [string, string, string][] = [
    ["accelerator", `${r.accel} (${r.accel_reason})`, ""],
    ["guest", `${r.guest_mem_mib} MiB, ${r.vcpus} vCPU`, ""],
    ["cold boot to first exec", `${r.boot_ms} ms`, ""],
    ["template snapshot", `${r.template_snapshot_ms} ms`, ""],
    ["spawn, pre-launched QEMU (pool hit)", stats(r.spawn_prelaunched_ms, "ms"), ""],
    ["  the pre-launch, ahead of it", stats(r.prelaunch_ms, "ms"), ""],
    ["spawn, cold (pool empty)", stats(r.spawn_ms, "ms"), ""],
    ["  of which restore", stats(r.spawn_restore_ms, "ms"), ""],
    [
      "  parts (p50)",
      `setup ${r.spawn_parts_ms.setup.p50}, launch ${r.spawn_parts_ms.launch.p50}, load ${r.spawn_parts_ms.load.p50}, hello ${r.spawn_parts_ms.hello.p50}, identity ${r.spawn_parts_ms.identity.p50} ms`,
      "",
    ],
    ["floor: bare QEMU restore", stats(r.floor_restore_ms, "ms"), ""],
    ["spawn cold / floor (p50)", `${r.spawn_vs_floor}x`, goal(t.spawn_vs_floor, "<=", "x")],
    ["exec `true` round trip", stats(r.exec_rtt_ms, "ms"), goal(t.exec_rtt_p50_ms, "p50 <", " ms")],
    [
      `fork: parent stall (${r.fork_method}, one child)`,
      stats(r.fork_parent_stall_summary_ms, "ms"),
      goal(t.fork_parent_stall_ms, "p50 <", " ms"),
    ],
    ["  reference: stop-and-copy, same run", stats(r.fork_stop_copy_stall_ms, "ms"), ""],
    ["  populate before the stop", stats(r.fork_populate_ms, "ms"), ""],
    [`  stall of the ${r.fork_children}-child fork`, `${r.fork_children_stall_ms} ms`, ""],
    [
      `fork: ${r.fork_children} children answering`,
      `${r.fork_children_ms} ms`,
      goal(t.fork_children_ms, "<", " ms"),
    ],
    [
      `  answering the agent (identity set)`,
      `${r.fork_children_ready_ms} ms (${r.fork_children_vs_floor}x the floor)`,
      goal(t.fork_children_vs_floor, "<=", "x"),
    ],
    [`  floor: ${r.fork_children} bare restores at once`, `${r.fork_children_floor_ms} ms`, ""],
    [
      "  stop-and-copy: stall, answering",
      `${r.fork_children_stop_copy.stall_ms} ms, ${r.fork_children_stop_copy.ready_ms} ms (${r.fork_children_stop_copy.vs_floor}x)`,
      "",
    ],
    [
      `kept snapshot: source stall (${r.fork_method})`,
      `${r.snapshot_stall_ms} ms (${r.snapshot_stall_vs_fork_stall}x the fork's p50)`,
      "",
    ],
    ["  the whole take", `${r.snapshot_ms} ms, ${(r.snapshot_bytes / 2 ** 20).toFixed(1)} MiB kept`, ""],
    [
      "restore in place (rollback)",
      stats(r.restore_in_place_ms, "ms"),
      goal(t.restore_in_place_ms, "p50 <", " ms"),
    ],
    ["  of which down", stats(r.restore_in_place_down_ms, "ms"), ""],
    ["  cold (no standby)", stats(r.restore_in_place_cold_ms, "ms"), ""],
    ["  down: state load", stats(p.load, "ms"), ""],
    ["  down: cont to HELLO", stats(p.hello, "ms"), ""],
    ["  down: identity", stats(p.identity, "ms"), ""],
    [
      "  rollback / floor, down / floor (p50)",
      `${r.restore_in_place_vs_floor}x, ${r.restore_in_place_down_vs_floor}x`,
      "",
    ],
    ["new VM from the snapshot (restore)", stats(r.from_snapshot_ms, "ms"), ""],
    [
      "  / floor, / spawn's restore (p50)",
      `${r.from_snapshot_vs_floor}x, ${r.from_snapshot_vs_spawn_restore}x`,
      "",
    ],
    ["suspend to disk", `${r.suspend_ms} ms`, ""],
    ["resume", `${r.resume_ms} ms`, ""],
    [
      `host memory per idle VM (PSS, ${r.idle_vms} VMs)`,
      `${r.host_rss_per_idle_vm_mb} MiB`,
      goal(t.host_rss_per_idle_vm_mb, "<", " MiB"),
    ],
    ["  guest pages it dirtied", `${m.guest_ram_dirty} MiB`, ""],
    ["  template pages, shared (PSS)", `${m.guest_ram_shared} MiB`, ""],
    ["  QEMU's own (PSS)", `${m.qemu_own} MiB`, ""],
    ["  RSS (shared pages counted fully)", `${m.rss} MiB`, ""],
    ["template RAM file (once per template)", `${r.template_ram_file_mb} MiB`, ""],
    ["benchmark run", `${(r.total_ms / 1000).toFixed(1)} s`, ""],
  ];
  const w0 = Math.max(...rows.map((x) => x[0].length));
  // Only rows with a goal are padded: the accelerator's reason may be long.
  const w1 = Math.max(...rows.filter((x) => x[2]).map((x) => x[1].length));
  return rows.map(([a, b, c]) => `${a.padEnd(w0)}  ${c ? b.padEnd(w1) : b}${c ? `  ${c}` : ""}`).join("\n");
}

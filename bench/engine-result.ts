/**
 * What `sandboxd bench` reports for the snapshot engine (docs/benchmarks.md says what each figure
 * is) and the engine's goals, which live here only: timed tests never assert speed.
 */
import type { Accel } from "../agent/qemu/launch.ts";
import type { ForkMethod } from "../agent/snapshot/fork-method.ts";
import type { Summary } from "./stats.ts";

/** A cold spawn's parts (RestoreTimings), each a summary over the run's spawns. */
export interface SpawnParts {
  /** Before QEMU starts: the overlay on the template's disk, the jail, the agent's records. */
  setup: Summary;
  /** QEMU started in its jail to its QMP answering (`launchMs`). */
  launch: Summary;
  /** The ~60 KB device state loaded (`incomingMs`); the RAM is the template's file, mapped. */
  load: Summary;
  /** `cont` to the guest's HELLO answer (`helloMs`): the floor pays it too. */
  hello: Summary;
  /** HELLO answered to entropy, clock and hostname set (`identityMs`): the floor has a PING there. */
  identity: Summary;
}

/** A goal: `spawn_vs_floor` must be at most `limit`, every other figure below it. */
export interface Target {
  limit: number;
  value: number;
  pass: boolean;
}

export interface MemoryBreakdown {
  /** Mean over the idle VMs, MiB: PSS of the whole QEMU process (= host_rss_per_idle_vm_mb). */
  pss: number;
  /** Plain RSS (shared pages counted fully in every process): an upper bound, for reference. */
  rss: number;
  /** Pages only this QEMU has and wrote: QEMU's heap and code cache + the guest's dirtied pages. */
  private_dirty: number;
  /** Guest pages this VM wrote since the restore (copy-on-write copies of template RAM). */
  guest_ram_dirty: number;
  /** Template RAM pages the guest read, shared with the other VMs, PSS (1/N of each page). */
  guest_ram_shared: number;
  /** Everything outside the guest RAM mapping, PSS: QEMU itself (TCG's code cache included). */
  qemu_own: number;
}

/** A fork's time, part by part (agent/snapshot/fork.ts ForkTimings). */
export interface ForkBreakdown {
  /** Fork call to the copy's start, populate aside: tmpfs and chain checks, the parent's new overlay. */
  prepare: number;
  /** Background snapshot: the parent's unmapped RAM pages read in, guest running. */
  populate: number;
  /** The parent's vCPUs stopped (STOP to RESUME). */
  parent_stall: number;
  /**
   * The RAM streamed into the fork point's RAM file and device state (ram-split.ts), after the
   * parent runs again (a background snapshot; 0 for stop-copy, whose copy is the stall).
   */
  stream: number;
  /** The children's disk base checked against the records (flattened past the chain bound), beside their launches. */
  child_base: number;
  /** Per child: its overlay, jail and QEMU started (`-incoming defer`), during the stream. */
  child_launch: { p50: number; max: number };
  /** Per child: the device state loaded, waiting first for the stream to end. */
  child_load: { p50: number; max: number };
  /** Per child: `cont` to the guest's HELLO. */
  child_hello: { p50: number; max: number };
  /** Per child: entropy, clock, hostname and boot id set. */
  child_identity: { p50: number; max: number };
  /** Every child answering (identity set) to every child's first `true` answered. */
  first_exec: number;
}

export interface BenchResult {
  accel: Accel;
  accel_reason: string;
  guest_mem_mib: number;
  vcpus: number;
  /** QEMU start of a cold boot until the first exec (`true`) answered. */
  boot_ms: number;
  /** Freezing the booted template VM: stop + device-state save (RAM stays in its shared file). */
  template_snapshot_ms: number;
  /**
   * A cold spawn (the agent's pre-launch pool empty): spawnFromTemplate call to its return, overlay
   * made, jail built, QEMU started and restored, HELLO answered, identity set.
   */
  spawn_ms: Summary;
  /** The restore part of spawn_ms (QEMU start to identity set), as the engine times it. */
  spawn_restore_ms: Summary;
  /** spawn_ms split as the engine times it: where a cold spawn spends what the floor does not. */
  spawn_parts_ms: SpawnParts;
  /**
   * A spawn that takes a QEMU pre-launched in its jail (the agent's pool hit, the usual case):
   * spawnFromTemplate with `prelaunched` to its return: state loaded, `cont`, HELLO, identity.
   */
  spawn_prelaunched_ms: Summary;
  /** The pre-launch itself (overlay, jail, QEMU start, QMP), done ahead of the spawn, off its path. */
  prelaunch_ms: Summary;
  /** A bare QEMU restore of the same template, QEMU start to the guest's PING answer (floorRestoreMs). */
  floor_restore_ms: Summary;
  /** spawn_ms.p50 / floor_restore_ms.p50. */
  spawn_vs_floor: number;
  /** `true` round trips on a warm sandbox (exec request to its exit status). */
  exec_rtt_ms: Summary;
  /** The method the forks used (after readyForkMethod: a snapshot may fall back to stop-copy). */
  fork_method: ForkMethod;
  /**
   * Time the parent's vCPUs stood still during a fork, QEMU's STOP to RESUME event timestamps:
   * the p50 of FORK_STALL_SAMPLES one-child forks by `fork_method`.
   */
  fork_parent_stall_ms: number;
  fork_parent_stall_summary_ms: Summary;
  /** The same one-child forks by stop-and-copy, interleaved with those: the reference. */
  fork_stop_copy_stall_ms: Summary;
  /** Snapshot: reading in the unmapped RAM pages before the stop (guest running), per fork. */
  fork_populate_ms: Summary;
  /** The stall of the timed fork of `fork_children` children. */
  fork_children_stall_ms: number;
  fork_children: number;
  /** forkVm call until all children answered an exec. */
  fork_children_ms: number;
  /**
   * forkVm call until every child answered the agent with its identity set: the like of the
   * floor's restores, which end at the guest's answer to a PING.
   */
  fork_children_ready_ms: number;
  /**
   * The floor for that: as many bare QEMU restores of the template started at once, until every
   * guest answered (floorRestoreMs each): what the host allows that many VMs to come up in.
   */
  fork_children_floor_ms: number;
  /** fork_children_ready_ms / fork_children_floor_ms (the goal: at most 1.5). */
  fork_children_vs_floor: number;
  /** fork_children_ms / fork_children_floor_ms: the children's first exec included. */
  fork_children_exec_vs_floor: number;
  /** Where the timed fork's time went, in order (ForkTimings; per child: p50 and max). */
  fork_children_breakdown_ms: ForkBreakdown;
  /** The same fork by stop-and-copy (the parent stopped for the whole copy), right after. */
  fork_children_stop_copy: {
    stall_ms: number;
    ready_ms: number;
    ms: number;
    vs_floor: number;
    breakdown_ms: ForkBreakdown;
  };
  /** Kept snapshot (keep.ts keepVm) of a fresh sandbox by `fork_method`: its stall, STOP to RESUME. */
  snapshot_stall_ms: number;
  /** snapshot_stall_ms / fork_parent_stall_ms: a snapshot's stall beside a one-child fork's. */
  snapshot_stall_vs_fork_stall: number;
  /** The whole take: keepVm call to its return (capture, memory image, copy to the data disk). */
  snapshot_ms: number;
  /** What the data disk keeps for it (the record's sizeBytes): image and state, the disk base. */
  snapshot_bytes: number;
  /** Rollbacks of that sandbox to it in place (restoreInPlace), the whole call (`totalMs`). */
  restore_in_place_ms: Summary;
  /** Their down part (`downMs`): old QEMU stopped to the new guest answering, identity set. */
  restore_in_place_down_ms: Summary;
  /** The down part split as the engine times it (RestoreTimings; the standby had no launch left). */
  restore_in_place_parts_ms: {
    /** Device state loaded into the standby, the old QEMU's kill beside it (`incomingMs`). */
    load: Summary;
    /** `cont` to the guest's HELLO (`helloMs`). */
    hello: Summary;
    /** Entropy, clock, hostname set (`identityMs`). */
    identity: Summary;
  };
  /** Rollbacks with no standby (its QEMU launched on the spot): after an agent restart, or to another snapshot. */
  restore_in_place_cold_ms: Summary;
  /** restore_in_place_ms.p50 / floor_restore_ms.p50. */
  restore_in_place_vs_floor: number;
  /** restore_in_place_down_ms.p50 / floor_restore_ms.p50. */
  restore_in_place_down_vs_floor: number;
  /** New VMs started from the kept snapshot (startFromKept): QEMU start to identity set (`readyMs`). */
  from_snapshot_ms: Summary;
  /** from_snapshot_ms.p50 / floor_restore_ms.p50. */
  from_snapshot_vs_floor: number;
  /** from_snapshot_ms.p50 / spawn_restore_ms.p50: from the kept image beside from the template. */
  from_snapshot_vs_spawn_restore: number;
  /** Suspend to disk of a running sandbox (stop + full RAM save, QEMU ended). */
  suspend_ms: number;
  /** resumeVm call until the guest answered and its identity was set. */
  resume_ms: number;
  idle_vms: number;
  /** Mean PSS of the idle, paused sandboxes' QEMU processes, MiB. */
  host_rss_per_idle_vm_mb: number;
  host_memory_per_idle_vm_mb: MemoryBreakdown;
  /** The template's RAM file on tmpfs (paid once per template, not per VM), MiB. */
  template_ram_file_mb: number;
  total_ms: number;
  targets: {
    spawn_vs_floor: Target;
    exec_rtt_p50_ms: Target;
    fork_parent_stall_ms: Target;
    fork_children_ms: Target;
    fork_children_vs_floor: Target;
    host_rss_per_idle_vm_mb: Target;
    restore_in_place_ms: Target;
  };
}

/** The engine's goals. Here only: timed tests never assert speed. */
export const TARGETS = {
  /** Spawn p50 at most 1.3x a bare QEMU restore: our code adds at most 30 %. */
  spawnVsFloorMax: 1.3,
  /** A warm exec round trip below 15 ms. */
  execRttP50BelowMs: 15,
  /** A fork stops the parent for less than 50 ms (forkd pauses its parent 56 ms). */
  forkStallBelowMs: 50,
  /** 8 children all answering within 1 s of the fork call. */
  forkChildrenBelowMs: 1000,
  /** N children answering within 1.5x N bare restores started at once, in the same run. */
  forkChildrenVsFloorMax: 1.5,
  /** An idle sandbox costs the host less than 40 MiB. */
  rssBelowMb: 40,
  /** A rollback in place (restore_in_place_ms p50) under 100 ms: the product's goal for a 256 MiB guest. */
  restoreInPlaceBelowMs: 100,
} as const;

export function target(value: number, limit: number, kind: "max" | "below"): Target {
  return { limit, value, pass: kind === "max" ? value <= limit : value < limit };
}

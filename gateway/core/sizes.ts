/**
 * Size classes (docs/templates.md "Size classes"): which sizes a template's sandboxes may be
 * created with, and the class a create names. Each class is a frozen snapshot of its own on the
 * agent, so a size outside them cannot be started and is refused here, before a record is
 * reserved or an agent asked.
 */
import { SandboxdError } from "../../contracts/errors.ts";

export interface Size {
  vcpus: number;
  memMib: number;
}

/** What a create asked for: either field, both or neither. */
export type SizeWish = Partial<Size>;

/** The public shape of a class (contracts/api/sandboxes-api.ts `SizeClass`). */
export function publicSize(s: Size): { vcpus: number; memory_mib: number } {
  return { vcpus: s.vcpus, memory_mib: s.memMib };
}

/**
 * A template's size classes, its default first: a bake's `sizes`, else the one size it was built
 * with when both its fields are known (a sessions API upload's `vcpu_count` and `mem_mib`), else
 * none (it runs at the host's default size, which the gateway does not know).
 */
export function sizesOf(row: { spec: unknown; vcpuCount: number | null; memMib: number | null }): Size[] {
  const declared = (row.spec as { sizes?: { vcpus: number; memory_mib: number }[] }).sizes;
  if (Array.isArray(declared)) return declared.map((s) => ({ vcpus: s.vcpus, memMib: s.memory_mib }));
  if (row.vcpuCount !== null && row.memMib !== null) return [{ vcpus: row.vcpuCount, memMib: row.memMib }];
  return [];
}

function named(want: SizeWish): boolean {
  return want.vcpus !== undefined || want.memMib !== undefined;
}

function fits(s: Size, want: SizeWish): boolean {
  return (
    (want.vcpus === undefined || want.vcpus === s.vcpus) &&
    (want.memMib === undefined || want.memMib === s.memMib)
  );
}

function describe(want: SizeWish): string {
  const parts = [
    ...(want.vcpus !== undefined ? [`${want.vcpus} vCPU`] : []),
    ...(want.memMib !== undefined ? [`${want.memMib} MiB`] : []),
  ];
  return parts.join(" / ");
}

/**
 * The class of template `id` that `want` names: the first (in the template's order) whose fields
 * equal those given; undefined when none is named (the template's default). A size it lacks is
 * 400 `size_unavailable` with `details.sizes`, the classes it has.
 */
export function pickTemplateSize(id: string, sizes: Size[], want: SizeWish): Size | undefined {
  if (!named(want)) return undefined;
  const hit = sizes.find((s) => fits(s, want));
  if (hit) return hit;
  const message =
    sizes.length === 0
      ? `template ${id} has no size classes: it runs at the host's default size only; create it without vcpus and memory_mib`
      : `template ${id} has no size class of ${describe(want)}; its classes: ${sizes.map((s) => `${s.vcpus} vCPU / ${s.memMib} MiB`).join(", ")}`;
  throw new SandboxdError("size_unavailable", message, {
    details: { template: id, sizes: sizes.map(publicSize) },
  });
}

/**
 * A create from a kept snapshot: its size is the one it was taken at, fixed by the memory image
 * it restores. Naming that size (or nothing) is allowed; anything else is 400 `size_unavailable`.
 */
export function checkSnapshotSize(
  id: string,
  snap: { vcpus: number | null; memMib: number | null },
  want: SizeWish,
): void {
  if (!named(want)) return;
  const own =
    snap.vcpus !== null && snap.memMib !== null ? { vcpus: snap.vcpus, memMib: snap.memMib } : undefined;
  if (own && fits(own, want)) return;
  throw new SandboxdError(
    "size_unavailable",
    `a snapshot's size is fixed: snapshot ${id} restores ${own ? `${own.vcpus} vCPU / ${own.memMib} MiB` : "at the size it was taken with"}; create it without vcpus and memory_mib${own ? " or with exactly those" : ""}`,
    { details: { snapshot: id, sizes: own ? [publicSize(own)] : [] } },
  );
}

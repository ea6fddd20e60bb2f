/**
 * After an agent restart: free the snapshot files whose users are gone. Run it after
 * `reapOrphanVms` (which kills the QEMUs of dead owners and removes their VM dirs): a "vm:<id>"
 * holder without a VM dir, and every "fork:" holder (a fork in progress when the agent died),
 * no longer need anything. Templates ("template:<id>") keep their files while their meta.json
 * exists, kept snapshots ("kept:<ref>") while their record does. Returns the freed paths.
 */
import { existsSync } from "node:fs";
import { join, resolve } from "node:path";
import { forgetChainStore, openChainStore } from "../storage/chain.ts";
import { vmsRoot } from "../vm/workdir.ts";
import { keptRoot } from "./keep.ts";
import { templatesRoot } from "./template.ts";

export async function reclaimSnapshotStorage(dataDir: string): Promise<string[]> {
  const abs = resolve(dataDir);
  forgetChainStore(abs); // re-read the table as the crashed process left it
  const chain = await openChainStore(abs);
  return chain.releaseWhere((holder) => {
    const [kind, id = ""] = holder.split(/:(.*)/s);
    if (kind === "vm") return !existsSync(join(vmsRoot(abs), id));
    if (kind === "template") return !existsSync(join(templatesRoot(abs), id, "meta.json"));
    // A kept snapshot (keep.ts) keeps its files while its record exists.
    if (kind === "kept") return !existsSync(join(keptRoot(abs), `${id}.json`));
    return true; // "fork:" and anything unknown: transient
  });
}

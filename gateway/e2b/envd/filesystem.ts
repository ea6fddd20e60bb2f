/** envd's `filesystem.Filesystem` service over the sandbox's files (docs/e2b.md "Filesystem"). */
import type { ServiceImpl } from "@connectrpc/connect";
import type { Filesystem } from "../../../contracts/e2b/envd/filesystem_pb.ts";
import type { Deps } from "../../deps.ts";

export function filesystemService(_deps: Deps): Partial<ServiceImpl<typeof Filesystem>> {
  return {};
}

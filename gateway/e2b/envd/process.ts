/** envd's `process.Process` service over sandboxd's processes and terminals (docs/e2b.md "Processes"). */
import type { ServiceImpl } from "@connectrpc/connect";
import type { Process } from "../../../contracts/e2b/envd/process_pb.ts";
import type { Deps } from "../../deps.ts";

export function processService(_deps: Deps): Partial<ServiceImpl<typeof Process>> {
  return {};
}

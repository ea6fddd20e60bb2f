import { randomBytes } from "node:crypto";

/**
 * The agent's one id scheme for VMs: `vm-<16 hex>`, made here only. An id names the VM's
 * directory (`<stateDir>/vms/<id>`), its holder in the chain store (`vm:<id>`) and the guest's
 * hostname, so it is an RFC 1123 label; and it does not look like the gateway's public ids
 * (`sbx_…`, `sess_…`), which the gateway maps onto these.
 */
/** What `newVmId` makes: a VM id read back from a file is held to it. */
export const VM_ID_PATTERN = /^vm-[0-9a-f]{16}$/;

export function newVmId(): string {
  return `vm-${randomBytes(8).toString("hex")}`;
}

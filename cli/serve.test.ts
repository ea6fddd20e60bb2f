import { expect, test } from "bun:test";
import { checkDestination } from "../agent/egress/fence.ts";
import { fencedRegistry } from "../agent/sandbox/drivers/snapshot.ts";
import { agentFences } from "./serve.ts";

test("a range allowed for registry pulls stays closed to sandboxes, and the reverse", async () => {
  const { sandboxes, registries } = agentFences({
    egressAllowInternal: "10.1.0.0/16",
    registryAllowInternal: "10.0.0.5/32",
  });
  // The private registry: the agent's pull check lets it through, a sandbox's fence refuses it.
  await fencedRegistry(registries)("10.0.0.5", 5000);
  expect(await checkDestination("10.0.0.5", 5000, sandboxes)).toMatchObject({ ok: false, code: "internal" });
  // A range opened to sandboxes is not a place bakes pull from.
  expect(await checkDestination("10.1.2.3", 80, sandboxes)).toMatchObject({ ok: true });
  await expect(fencedRegistry(registries)("10.1.2.3", 5000)).rejects.toMatchObject({ code: "forbidden" });
});

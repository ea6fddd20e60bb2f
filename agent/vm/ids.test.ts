import { expect, test } from "bun:test";
import { newVmId } from "./ids.ts";

test("VM ids are vm-<16 hex>: RFC 1123 labels, unlike the gateway's sbx_/sess_ ids", () => {
  const ids = new Set(Array.from({ length: 100 }, newVmId));
  expect(ids.size).toBe(100);
  for (const id of ids) expect(id).toMatch(/^vm-[0-9a-f]{16}$/);
});

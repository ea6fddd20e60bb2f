/**
 * E2B's file metadata (xattrs `user.e2b.<key>`) through the data plane in a running service
 * (`bin/sandboxd up`, real VMs of the `base` catalog template, run as `user`), driven by E2B's
 * SDK, unmodified (`e2b` 2.45.0): written with an upload (octet-stream and multipart, keys
 * lowercased), shown by getInfo, list and rename, cleared by an upload without it, xattrs set in
 * the sandbox itself shown too, and metadata past the bounds refused with nothing written.
 */
import { expect, test } from "bun:test";
import { InvalidArgumentError, Sandbox } from "e2b";
import {
  MAX_METADATA_KEY_BYTES,
  MAX_METADATA_KEYS,
  MAX_METADATA_TOTAL_BYTES,
} from "../../contracts/agent/fs-ops.ts";
import { e2bKeyOf } from "../../contracts/e2b/ids.ts";
import { useService } from "../support/service.ts";

/** One create and some twenty file calls under TCG on a loaded 2-core host. */
const TEST_TIMEOUT_MS = 300_000;

const fx = useService({ prefix: "sbx-e2e-e2bmeta-", catalog: ["base"], keys: { pro: ["acme", "pro"] } });

async function create(): Promise<Sandbox> {
  const sbx = await Sandbox.create("base", {
    apiKey: e2bKeyOf(fx.keys.pro),
    apiUrl: `${fx.svc.url}/e2b`,
    sandboxUrl: `${fx.svc.url}/e2b/envd`,
    timeoutMs: 120_000,
  });
  fx.cleanup(() => sbx.kill());
  return sbx;
}

test(
  "metadata is written, read, listed, kept by a rename, cleared by an overwrite; bounds refused",
  async () => {
    const sbx = await create();
    const f = sbx.files;

    // octet-stream: keys arrive as header names, lowercased.
    const meta = { Author: "mish", purpose: "upload" };
    const want = { author: "mish", purpose: "upload" };
    const w = await f.write("m/octet.txt", "x", { metadata: meta, useOctetStream: true });
    expect(w.metadata).toEqual(want);
    expect((await f.getInfo("m/octet.txt")).metadata).toEqual(want);

    // multipart: the same metadata on every file.
    const many = await f.writeFiles(
      [
        { path: "m/one.txt", data: "1" },
        { path: "m/two.txt", data: "2" },
      ],
      { metadata: { source: "suite" } },
    );
    expect(many.map((i) => i.metadata)).toEqual([{ source: "suite" }, { source: "suite" }]);
    await f.write("m/plain.txt", "no metadata");

    // list: each entry's own (one without any has none).
    const listed = Object.fromEntries((await f.list("m")).map((e) => [e.name, e.metadata]));
    expect(listed).toEqual({
      "octet.txt": want,
      "one.txt": { source: "suite" },
      "two.txt": { source: "suite" },
      "plain.txt": undefined,
    });
    expect((await f.getInfo("m/plain.txt")).metadata).toBeUndefined();

    // rename: the xattrs move with the inode.
    const moved = await f.rename("m/one.txt", "m/moved.txt");
    expect(moved.metadata).toEqual({ source: "suite" });
    expect((await f.getInfo("m/moved.txt")).metadata).toEqual({ source: "suite" });

    // An upload replaces the file: without metadata it has none.
    expect((await f.write("m/two.txt", "again")).metadata).toBeUndefined();
    expect((await f.getInfo("m/two.txt")).metadata).toBeUndefined();

    // Set in the sandbox itself, by the user, out of band: shown with the prefix removed.
    const set = await sbx.commands.run(
      `python3 -c "import os; os.setxattr('/home/user/m/plain.txt', 'user.e2b.k', b'v'); os.setxattr('/home/user/m/plain.txt', 'user.other', b'no')"`,
    );
    expect(set.exitCode).toBe(0);
    expect((await f.getInfo("/home/user/m/plain.txt")).metadata).toEqual({ k: "v" });

    // Written as the calling user: the file and its xattrs are the user's.
    const owner = await sbx.commands.run("stat -c %U /home/user/m/octet.txt");
    expect(owner.stdout.trim()).toBe("user");

    // Past the bounds: 400 (the SDK's InvalidArgumentError), nothing written.
    const tooMany = Object.fromEntries(
      Array.from({ length: MAX_METADATA_KEYS + 1 }, (_, i) => [`k${i}`, "v"]),
    );
    const tooLongKey = { ["k".repeat(MAX_METADATA_KEY_BYTES + 1)]: "v" };
    const tooBig = { big: "v".repeat(MAX_METADATA_TOTAL_BYTES) };
    for (const metadata of [tooMany, tooLongKey, tooBig]) {
      for (const useOctetStream of [true, false]) {
        const err = await f.write("m/refused.txt", "x", { metadata, useOctetStream }).catch((e) => e);
        expect(err).toBeInstanceOf(InvalidArgumentError);
        expect(String(err.message)).toContain("metadata");
      }
    }
    expect(await f.exists("m/refused.txt")).toBe(false);
  },
  TEST_TIMEOUT_MS,
);

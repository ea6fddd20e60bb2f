/** envd's upload headers `X-Metadata-<key>`: what an upload's metadata is, and what is refused. */
import { describe, expect, test } from "bun:test";
import { SandboxdError } from "../../../contracts/errors.ts";
import { metadataOf } from "./files.ts";

describe("metadataOf", () => {
  test("keys lowercased, other headers ignored, none is undefined", () => {
    const h = new Headers({ "X-Metadata-Author": "mish", "x-metadata-purpose": "up load", "X-Other": "no" });
    expect(metadataOf(h)).toEqual({ author: "mish", purpose: "up load" });
    expect(metadataOf(new Headers({ "content-type": "text/plain" }))).toBeUndefined();
  });
  test("past the bounds or outside printable ASCII: bad_request naming metadata", () => {
    const refused = (h: Headers) => {
      try {
        metadataOf(h);
      } catch (err) {
        return err instanceof SandboxdError && err.code === "bad_request" && /metadata/.test(err.message);
      }
      return false;
    };
    expect(refused(new Headers({ "X-Metadata-k": "caf\u00e9" }))).toBe(true);
    expect(refused(new Headers({ [`X-Metadata-${"k".repeat(247)}`]: "v" }))).toBe(true);
    expect(refused(new Headers({ "X-Metadata-k": "v".repeat(4096) }))).toBe(true);
    const many = new Headers();
    for (let i = 0; i < 65; i++) many.set(`X-Metadata-k${i}`, "v");
    expect(refused(many)).toBe(true);
  });
});

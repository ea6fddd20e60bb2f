import { expect, test } from "bun:test";
import { gatewayStart, readSettings } from "./settings.ts";

function publicUrl(flags: Record<string, unknown>, env: Record<string, string>) {
  const r = readSettings(flags, env, () => "");
  if (!r.ok) throw new Error(r.error);
  return gatewayStart(r.settings).publicBaseUrl;
}

function refusal(flags: Record<string, unknown>): string {
  const r = readSettings(flags, {}, () => "");
  return r.ok ? "accepted" : r.error;
}

test("--public-url wins over SANDBOXD_PUBLIC_URL; neither: none (connect URLs follow the request)", () => {
  const env = { SANDBOXD_PUBLIC_URL: "https://env.example.test" };
  expect(publicUrl({ "public-url": "https://flag.example.test:8443/ignored/path" }, env)).toBe(
    "https://flag.example.test:8443",
  );
  expect(publicUrl({}, env)).toBe("https://env.example.test");
  expect(publicUrl({}, {})).toBeUndefined();
  expect(publicUrl({}, { SANDBOXD_PUBLIC_URL: "" })).toBeUndefined();
});

test("a public URL that is not an http(s) or ws(s) URL is refused at start", () => {
  expect(refusal({ "public-url": "not a url" })).toMatch(/SANDBOXD_PUBLIC_URL \(--public-url\).*not a URL/);
  expect(refusal({ "public-url": "ftp://x.example.test" })).toMatch(/http\(s\)/);
});

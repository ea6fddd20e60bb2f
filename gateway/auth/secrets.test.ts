/**
 * The server secrets: the environment wins; otherwise each is generated once into
 * `<dataDir>/secrets/` (directory 0700, files 0600) and read back unchanged on every later load.
 */
import { afterEach, expect, test } from "bun:test";
import { mkdtempSync, readFileSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { loadSecrets } from "./secrets.ts";

const dirs: string[] = [];
function dataDir(): string {
  const d = mkdtempSync(join(tmpdir(), "sandboxd-secrets-"));
  dirs.push(d);
  return d;
}
afterEach(() => {
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
});

test("generated once into the data dir, private, distinct, stable across loads", () => {
  const d = dataDir();
  const first = loadSecrets(d, {});
  const values = [first.keyPepper, first.connectSecret, first.agentSecret];
  for (const v of values) expect(v).toMatch(/^[0-9a-f]{64}$/);
  expect(new Set(values).size).toBe(3);
  expect(loadSecrets(d, {})).toEqual(first);
  const dir = join(d, "secrets");
  expect(statSync(dir).mode & 0o777).toBe(0o700);
  for (const [file, value] of [
    ["key-pepper", first.keyPepper],
    ["connect-secret", first.connectSecret],
    ["agent-secret", first.agentSecret],
  ] as const) {
    expect(statSync(join(dir, file)).mode & 0o777).toBe(0o600);
    expect(readFileSync(join(dir, file), "utf8")).toBe(value);
  }
});

test("the environment wins over the files; an empty variable counts as unset", () => {
  const d = dataDir();
  const onDisk = loadSecrets(d, {});
  const set = { keyPepper: "pepper-from-env", connectSecret: "", agentSecret: "a" };
  expect(loadSecrets(d, set)).toEqual({
    keyPepper: "pepper-from-env",
    connectSecret: onDisk.connectSecret,
    agentSecret: "a",
  });
});

/**
 * Errors never vanish: a failure is handled, logged (contracts/best-effort.ts `bestEffort`), or
 * left to the one owner that reports it (`settled`, `awaitedLater`, `ifExists` say which). A bare
 * `.catch(() => {})` or an empty `catch {}` in product code must say on its line, or the line
 * above, why dropping the error loses nothing; product code throws errors of the tree
 * (contracts/errors.ts), never a bare `Error`.
 */
import { expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { join, resolve } from "node:path";

const REPO = resolve(import.meta.dir, "../..");
const product = spawnSync("git", ["ls-files", "-z", "*.ts"], { cwd: REPO, encoding: "utf8" })
  .stdout.split("\0")
  .filter(
    (f) =>
      f && !f.endsWith(".test.ts") && !f.startsWith("tests/") && !f.startsWith("sdk/typescript/examples/"),
  );

const SILENT =
  /\.catch\(\s*\(\s*\w*\s*\)\s*=>\s*(\{\s*\}|undefined|null|void 0)\s*\)|catch\s*(\(\w*\))?\s*\{\s*\}/;
const COMMENT = /\/\/|\/\*|^\s*\*/;

function scan(each: (file: string, lines: string[], i: number) => string | undefined): string[] {
  return product.flatMap((f) => {
    const lines = readFileSync(join(REPO, f), "utf8").split("\n");
    return lines.flatMap((_, i) => {
      const found = each(f, lines, i);
      return found === undefined ? [] : [`${f}:${i + 1}: ${found}`];
    });
  });
}

test("an error dropped on purpose says why, on its line or the line above", () => {
  const unexplained = scan((_, lines, i) => {
    const line = lines[i]!;
    if (!SILENT.test(line)) return undefined;
    return COMMENT.test(line) || COMMENT.test(lines[i - 1] ?? "") ? undefined : line.trim();
  });
  expect(unexplained).toEqual([]);
});

test("product code throws errors of the tree, not a bare Error", () => {
  // The SDK is its own package for users (its errors are its own tree), and the bench harness's
  // Interrupted is control flow; every other throw carries a stable code.
  const bare = scan((f, lines, i) =>
    !f.startsWith("sdk/") && /\bthrow new Error\(/.test(lines[i]!) ? lines[i]!.trim() : undefined,
  );
  expect(bare).toEqual([]);
});

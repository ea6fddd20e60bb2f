/**
 * The docs are the repository's own reference: every pointer into them from code, tests or other
 * docs lands on a file and a heading that exist, and nothing cites a document a reader of this
 * repository cannot open (sections of an outside specification, "spec 4.2"). A doc that is renamed
 * or a heading that is reworded fails here, with the places that still point at the old one.
 */
import { describe, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { dirname, join, normalize, resolve } from "node:path";

const REPO = resolve(import.meta.dir, "../..");
const tracked = spawnSync("git", ["ls-files", "-z"], { cwd: REPO, encoding: "utf8" })
  .stdout.split("\0")
  .filter((f) => f && existsSync(join(REPO, f)));
const textFiles = tracked.filter((f) => /\.(ts|js|c|h|md|py|yaml|sh|sql)$/.test(f) || f.startsWith("bin/"));
const THIS_FILE = "tests/style/docs.test.ts";

/** Each `# heading` of a markdown file, as written and as GitHub's anchor of it. */
function headingsOf(file: string): { text: string[]; anchors: Set<string> } {
  const text = readFileSync(join(REPO, file), "utf8")
    .split("\n")
    .filter((l) => /^#{1,6} /.test(l))
    .map((l) => l.replace(/^#+ /, "").trim());
  const anchors = new Set(
    text.map((h) =>
      h
        .toLowerCase()
        .replace(/[^a-z0-9 _-]/g, "")
        .replace(/ /g, "-"),
    ),
  );
  return { text, anchors };
}

/** Every line of every text file with its place, for the scans below. */
const lines = textFiles
  .filter((f) => f !== THIS_FILE)
  .flatMap((f) =>
    readFileSync(join(REPO, f), "utf8")
      .split("\n")
      .map((line, i) => ({ where: `${f}:${i + 1}`, file: f, line })),
  );

describe("docs", () => {
  test("every docs/NAME.md named anywhere exists", () => {
    const missing = lines.flatMap(({ where, line }) =>
      [...line.matchAll(/\bdocs\/([A-Za-z0-9_-]+\.md)/g)]
        .filter((m) => !existsSync(join(REPO, "docs", m[1]!)))
        .map((m) => `${where}: docs/${m[1]}`),
    );
    expect(missing).toEqual([]);
  });

  test('every docs/NAME.md "Heading" and docs/NAME.md#anchor names a heading of that doc', () => {
    const wrong: string[] = [];
    for (const { where, line } of lines) {
      for (const m of line.matchAll(/\bdocs\/([A-Za-z0-9_-]+\.md),? "([^"]+)"/g)) {
        const doc = join("docs", m[1]!);
        if (!existsSync(join(REPO, doc))) continue; // the test above says so
        if (!headingsOf(doc).text.some((h) => h.startsWith(m[2]!))) wrong.push(`${where}: ${doc} "${m[2]}"`);
      }
      for (const m of line.matchAll(/\bdocs\/([A-Za-z0-9_-]+\.md)#([a-z0-9_-]+)/g)) {
        const doc = join("docs", m[1]!);
        if (!existsSync(join(REPO, doc))) continue;
        if (!headingsOf(doc).anchors.has(m[2]!)) wrong.push(`${where}: ${doc}#${m[2]}`);
      }
    }
    expect(wrong).toEqual([]);
  });

  test("every relative link of a markdown file resolves", () => {
    const broken: string[] = [];
    for (const { where, file, line } of lines) {
      if (!file.endsWith(".md")) continue;
      for (const m of line.matchAll(/\]\(([^)\s#]+)(#[^)\s]*)?\)/g)) {
        const target = m[1]!;
        if (/^[a-z]+:/.test(target)) continue; // http:, https:, mailto:
        if (!existsSync(join(REPO, normalize(join(dirname(file), target)))))
          broken.push(`${where}: ${target}`);
      }
    }
    expect(broken).toEqual([]);
  });

  test("docs/README.md, the index, links every doc of docs/", () => {
    const index = readFileSync(join(REPO, "docs/README.md"), "utf8");
    const docs = tracked.filter((f) => /^docs\/[^/]+\.md$/.test(f) && f !== "docs/README.md");
    expect(docs.filter((f) => !index.includes(`](${f.slice("docs/".length)})`))).toEqual([]);
  });

  test("nothing cites sections of a document outside the repository", () => {
    // The rules the code relies on are stated in docs/ (docs/api.md and the doc of each feature);
    // a comment points there, never at "spec 4.2" of a text a reader here cannot open.
    const citation = /\bspec(ification)?( sections?)? (§ ?)?\d+(\.\d+)*\b|§ ?\d+(\.\d+)*/i;
    const found = lines
      .filter(({ line }) => citation.test(line))
      .map(({ where, line }) => `${where}: ${line.trim()}`);
    expect(found).toEqual([]);
  });
});

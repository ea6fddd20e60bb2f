/**
 * A terminal driven by a program: open a shell in a new sandbox, type a command, read its output
 * until the answer shows, resize, and hang up.
 *
 *   SANDBOXD_URL=... SANDBOXD_API_KEY=... bun sdk/typescript/examples/terminal.ts
 *
 * Environment: SANDBOXD_TEMPLATE (default `python`).
 */
import { Sandboxd } from "@sandboxd/sdk";

/** How long to wait for the shell's answer: a login shell in an emulated VM may take a while. */
const ANSWER_WAIT_MS = 30_000;

const client = new Sandboxd();
const sbx = await client.sandboxes.create({ template: process.env.SANDBOXD_TEMPLATE ?? "python" });
try {
  const term = await sbx.terminal({ cols: 100, rows: 30 });
  let screen = "";
  const decoder = new TextDecoder();
  const answered = new Promise<void>((resolve, reject) => {
    const timer = setTimeout(
      () => reject(new Error(`no answer; the terminal showed: ${screen}`)),
      ANSWER_WAIT_MS,
    );
    term.onData((bytes) => {
      screen += decoder.decode(bytes, { stream: true });
      // The echo of the typed line has `$((6*7))`; the answer is 42 at the end of a line (after
      // the shell's own escape sequences, so not necessarily at its start).
      if (/(^|[^0-9])42\r?\n/.test(screen)) {
        clearTimeout(timer);
        resolve();
      }
    });
  });
  term.write("echo $((6*7))\n");
  await answered;
  console.log("terminal answered 42");
  term.resize(120, 40);
  const exit = await term.close();
  console.log(`terminal closed (${exit.code})`);
} finally {
  await sbx.delete();
}

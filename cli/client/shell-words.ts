/**
 * `sandboxd sbx exec ID ls -la /tmp`: the API runs one command line through /bin/sh -c, so the
 * words given are joined into one, each quoted where the shell would split or expand it, so the
 * command sees exactly the words typed.
 */

/** A word the shell passes through unchanged without quotes. */
const SAFE_WORD = /^[A-Za-z0-9_@%+=:,./-]+$/;

export function shellJoin(words: string[]): string {
  return words.map((w) => (SAFE_WORD.test(w) ? w : `'${w.replaceAll("'", `'\\''`)}'`)).join(" ");
}

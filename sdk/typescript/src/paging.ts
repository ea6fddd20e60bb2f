/**
 * The lists' paging (docs/lists.md), one piece for every list of the client: follow each page's
 * `nextCursor` until the last, and the `label=k:v` filter's query values.
 */
import type { Page } from "./types.ts";

/** Every page `page` gives, in order, each fetched when the loop asks for it. */
export async function* followPages<T>(page: (cursor?: string) => Promise<Page<T>>): AsyncGenerator<Page<T>> {
  let cursor: string | undefined;
  do {
    const p = await page(cursor);
    yield p;
    cursor = p.nextCursor ?? undefined;
  } while (cursor !== undefined);
}

/** Every row of every page, in order. */
export async function allRows<T>(pages: AsyncIterable<Page<T>>): Promise<T[]> {
  const out: T[] = [];
  for await (const page of pages) out.push(...page.items);
  return out;
}

/** `label` query values for pairs every row must hold. */
export function labelQuery(labels: Record<string, string> | undefined): string[] {
  return Object.entries(labels ?? {}).map(([k, v]) => `${k}:${v}`);
}

/**
 * Paged lists (docs/lists.md): the query fields and the answer's `next_cursor` every paged list
 * shares. Each list's own query (its filters) is beside its answer's schema.
 */
import { z } from "zod";
import {
  MAX_CURSOR_CHARS,
  MAX_LABEL_FILTERS,
  MAX_LABEL_KEY_CHARS,
  MAX_LABEL_VALUE_CHARS,
  MAX_LIST_LIMIT,
} from "./limits.ts";

/** `limit`: 1 to MAX_LIST_LIMIT, a decimal integer in the query; over it is 400, never clamped. */
export const ListLimit = z
  .string()
  .regex(/^\d{1,9}$/, "a decimal integer")
  .transform(Number)
  .pipe(z.int().min(1).max(MAX_LIST_LIMIT))
  .describe(`Rows per page, 1 to ${MAX_LIST_LIMIT} (default 50).`);

/** `cursor`: the previous page's `next_cursor`, as it came. */
export const ListCursor = z
  .string()
  .min(1)
  .max(MAX_CURSOR_CHARS)
  .regex(/^[A-Za-z0-9_.-]+$/, "a cursor this service issued (base64url)")
  .describe(
    "The `next_cursor` of the previous page, unchanged, sent with the same filters (another filter, another tenant's or an altered cursor is 400).",
  );

/**
 * `label=key:value`, repeatable, all AND-ed. The key is everything before the first `:` (so a key
 * holding `:` cannot be matched), the value the rest; the bounds are the Labels schema's.
 */
export const LabelSelector = z
  .string()
  .regex(
    new RegExp(`^[^:]{1,${MAX_LABEL_KEY_CHARS}}:[\\s\\S]{0,${MAX_LABEL_VALUE_CHARS}}$`),
    `key:value, a key of 1 to ${MAX_LABEL_KEY_CHARS} characters without ':' and a value of at most ${MAX_LABEL_VALUE_CHARS}`,
  );

export const LabelSelectors = z
  .array(LabelSelector)
  .max(MAX_LABEL_FILTERS, `at most ${MAX_LABEL_FILTERS} label filters`)
  .describe(
    `Repeatable \`label=key:value\`: only rows whose labels hold every pair (AND); at most ${MAX_LABEL_FILTERS}.`,
  );

/** The answer's cursor to the next page; null on the last page. */
export const NextCursor = z
  .string()
  .nullable()
  .describe("Pass as `cursor` (with the same filters) for the next page; null: this is the last page.");

import { expect, test } from "bun:test";
import { answerAfterBody } from "./early-answer.ts";

function post(bytes: number, headers: Record<string, string> = {}) {
  let read = 0;
  const chunk = new Uint8Array(64 * 1024);
  const body = new ReadableStream<Uint8Array>({
    pull(c) {
      if (read >= bytes) return c.close();
      read += chunk.byteLength;
      c.enqueue(chunk);
    },
  });
  const req = new Request("http://x/v1/sandboxes", {
    method: "POST",
    body,
    headers,
    duplex: "half",
  } as RequestInit);
  return { req, read: () => read };
}

test("an early error drains the unread body first; success and 100-continue are left alone", async () => {
  const small = post(1024 * 1024);
  const res = await answerAfterBody(small.req, new Response("{}", { status: 413 }));
  expect(res.status).toBe(413);
  expect(small.read()).toBeGreaterThanOrEqual(1024 * 1024);
  expect(res.headers.get("connection")).toBeNull();

  const big = post(8 * 1024 * 1024);
  const cut = await answerAfterBody(big.req, new Response("{}", { status: 413 }), {
    maxBytes: 1024 * 1024,
    maxMs: 5000,
  });
  expect(cut.headers.get("connection")).toBe("close");
  expect(big.read()).toBeLessThan(8 * 1024 * 1024);

  const ok = post(1024 * 1024);
  await answerAfterBody(ok.req, new Response("{}", { status: 200 }));
  const cont = post(1024 * 1024, { expect: "100-continue" });
  await answerAfterBody(cont.req, new Response("{}", { status: 413 }));
  expect(cont.read()).toBeLessThan(1024 * 1024);
});

/**
 * The read floor of `bench --gateway` (gateway.ts), run as its own process: a bare Hono
 * app on the gateway's own server adapter (gateway/runtime/) answering `GET /v1/sessions/{id}`
 * with a session's shape from memory, with no key check, rate limit or row. What an
 * authenticated read costs beyond this is the service's own work. Prints `listening URL` on
 * stdout, as `up` does, and serves until killed.
 */
import { Hono } from "hono";
import { serveFetch } from "../gateway/runtime/index.ts";

const app = new Hono();
const createdAt = Date.now();
app.get("/v1/sessions/:id", (c) => {
  // Refused without a key, as the gateway would: the header is read, as the real route's is.
  if (!c.req.header("authorization")) return c.json({ code: "unauthorized", message: "no key" }, 401);
  return c.json({
    session_id: c.req.param("id"),
    template_id: "gwbench",
    age_secs: (Date.now() - createdAt) / 1000,
    idle_secs: 0,
    exec_count: 0,
  });
});

const server = await serveFetch({
  fetch: (request) => app.fetch(request),
  hostname: "127.0.0.1",
  port: 0,
  // As the gateway's: long enough for any request this answers.
  requestTimeoutMs: 60_000,
});
process.stdout.write(`listening http://127.0.0.1:${server.port}\n`);

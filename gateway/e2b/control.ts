/**
 * E2B's control plane (docs/e2b.md "Control plane"): its REST paths over the sandboxes API's core.
 */
import { Hono } from "hono";
import type { Deps, HonoEnv } from "../deps.ts";
import type { E2bMountDeps } from "./mount.ts";

export function e2bControlRoutes(_deps: Deps, _m: E2bMountDeps): Hono<HonoEnv> {
  return new Hono<HonoEnv>();
}

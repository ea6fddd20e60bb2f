/**
 * The gateway and the agent share one set of bounds (contracts/api/limits.ts SHARED_BOUNDS): a
 * value the gateway accepts is one the agent accepts, and the gateway refuses what the agent
 * would. For every bound this walks both sides with `max` (accepted by both) and `max + 1`
 * (refused by both): the gateway through the public schemas its routes parse with and its config
 * check, the agent through its real HTTP app (agent/api/app.ts). The agent's manager is a sink
 * that answers 409 "reached the manager": a request that gets there passed every check of the
 * agent's edge. A bound added to SHARED_BOUNDS without a probe here fails the first test (and
 * does not compile). No VMs.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { z } from "zod";
import { createAgentApp } from "../../agent/api/app.ts";
import type { SandboxManager } from "../../agent/sandbox/manager.ts";
import { AGENT_API_PREFIX } from "../../contracts/agent/api.ts";
import { secretKey, signAgentToken } from "../../contracts/agent/token.ts";
import {
  AGENT_BODY_MARGIN_BYTES,
  AGENT_MAX_JSON_BODY_BYTES,
  DEFAULT_LIMITS,
  JSON_BODY_CEILING_BYTES,
  SHARED_BOUNDS,
} from "../../contracts/api/limits.ts";
import * as B from "../../contracts/api/sandboxes-api.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { resolveConfig } from "../../gateway/config.ts";

const CREDS = { id: "limits-agent", key: "limits-test-key-0123456789abcdef0123" };
let dir: string;
let agentApp: ReturnType<typeof createAgentApp>;

beforeAll(() => {
  dir = mkdtempSync(join(tmpdir(), "sbx-limits-"));
  // Every manager call ends at once with a code no edge check answers: "the edge let it through".
  const sink = new Proxy(
    {},
    {
      get: () => () => {
        throw new SandboxdError("conflict", "reached the manager");
      },
    },
  ) as SandboxManager;
  agentApp = createAgentApp({ manager: sink, credentials: CREDS, uploadDir: join(dir, "uploads") });
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** One request to the agent's app; accepted = it reached the manager (or the WebSocket step). */
async function agentAccepts(
  method: string,
  path: string,
  body?: string,
  headers: Record<string, string> = {},
) {
  const token = await signAgentToken(secretKey(CREDS.key), CREDS.id);
  const res = await agentApp.request(`${AGENT_API_PREFIX}${path}`, {
    method,
    headers: {
      authorization: `Bearer ${token}`,
      ...(body !== undefined && method !== "PUT" ? { "content-type": "application/json" } : {}),
      ...headers,
    },
    ...(body !== undefined ? { body } : {}),
  });
  const got = (await res.json()) as { code: string; message: string };
  if (res.status === 400 || res.status === 413) return false;
  // Anything else must be the sink (or, for a tunnel, the upgrade step after the port check).
  expect(["conflict", "unsupported"]).toContain(got.code);
  return true;
}

const agentExec = (body: Record<string, unknown>) =>
  agentAccepts("POST", "/vms/vm-limits/exec", JSON.stringify({ run: { kind: "none" }, ...body }));
const agentUpload = (q: string) => agentAccepts("PUT", `/templates/acme.tpl/upload?${q}`, "image-bytes");

const ok = (schema: z.ZodType, v: unknown) => schema.safeParse(v).success;
/** The gateway's config check: a deployment may not set a limit the agents would refuse past. */
function configOk(limits: Parameters<typeof resolveConfig>[0]["limits"]): boolean {
  try {
    resolveConfig({ keyPepper: "p".repeat(16), connectSecret: "c".repeat(16), uploadDir: dir, limits });
    return true;
  } catch {
    return false;
  }
}
const files = (n: number) => Array.from({ length: n }, (_, i) => ({ path: `/f${i}`, content: "" }));
const argv = (n: number) => Array.from({ length: n }, () => ["true"]);

interface Probe {
  gateway: (v: number) => boolean | Promise<boolean>;
  agent: (v: number) => Promise<boolean>;
}

const PROBES: Record<keyof typeof SHARED_BOUNDS, Probe> = {
  memMib: {
    gateway: (v) => ok(A.RegisterTemplateQuery, { id: "t", mem_mib: String(v) }),
    agent: (v) => agentUpload(`memMib=${v}`),
  },
  vcpus: {
    gateway: (v) => ok(A.RegisterTemplateQuery, { id: "t", vcpu_count: String(v) }),
    agent: (v) => agentUpload(`vcpuCount=${v}`),
  },
  waitSecs: {
    gateway: (v) => ok(A.RegisterTemplateQuery, { id: "t", wait_secs: String(v) }),
    agent: (v) => agentUpload(`waitSecs=${v}`),
  },
  execFiles: {
    gateway: (v) => ok(A.SessionExecRequest, { files: files(v) }) && ok(B.ExecRequestB, { files: files(v) }),
    agent: (v) => agentExec({ files: files(v) }),
  },
  pathChars: {
    gateway: (v) => ok(A.SessionExecRequest, { files: [{ path: "/".padEnd(v, "a"), content: "" }] }),
    agent: (v) => agentExec({ files: [{ path: "/".padEnd(v, "a"), content: "" }] }),
  },
  execCommands: {
    gateway: (v) =>
      ok(A.SessionExecRequest, { commands: argv(v) }) && ok(B.ExecRequestB, { commands: argv(v) }),
    agent: (v) => agentExec({ run: { kind: "argv", commands: argv(v) } }),
  },
  execTimeoutS: {
    gateway: (v) => configOk({ maxExecTimeoutS: v }),
    agent: (v) => agentExec({ timeoutMs: v * 1000 }),
  },
  forkCount: {
    gateway: (v) =>
      ok(B.ForkRequest, { count: v }) &&
      configOk({ forkCapByTier: { ...DEFAULT_LIMITS.forkCapByTier, enterprise: v } }),
    agent: (v) => agentAccepts("POST", "/vms/vm-limits/fork", JSON.stringify({ count: v })),
  },
  seedHexChars: {
    gateway: (v) => ok(B.ExecRequestB, { command: "true", seed: "a".repeat(v) }),
    agent: (v) => agentExec({ seed: "a".repeat(v) }),
  },
  imageRefChars: {
    gateway: (v) => ok(B.BakeTemplateRequest, { name: "t", image: "a".repeat(v) }),
    agent: (v) =>
      agentAccepts("PUT", "/templates/acme.tpl", JSON.stringify({ image: "a".repeat(v) }), {
        "content-type": "application/json",
      }),
  },
  templateWidth: {
    gateway: (v) =>
      ok(B.ExpectRequest, { width: v }) && ok(B.BakeTemplateRequest, { name: "t", image: "i", width: v }),
    agent: async (v) =>
      (await agentAccepts("POST", "/templates/acme.tpl/expect", JSON.stringify({ width: v }))) &&
      (await agentAccepts("PUT", "/templates/acme.tpl", JSON.stringify({ image: "i", width: v }), {
        "content-type": "application/json",
      })),
  },
  port: {
    gateway: (v) => ok(B.ConnectUrlRequest, { port: v, ttl_seconds: 60 }) && ok(B.ReadySpec, { ports: [v] }),
    agent: (v) => agentAccepts("GET", `/vms/vm-limits/tunnel?port=${v}`, undefined, { upgrade: "websocket" }),
  },
  jsonBodyBytes: {
    gateway: (v) => configOk({ maxJsonBodyBytes: v }),
    // A client body of `v` bytes, re-encoded by the gateway with its own fields around it: the
    // agent takes it as long as it is within the margin.
    agent: (v) => {
      const frame = JSON.stringify({ run: { kind: "none" }, files: [{ path: "/big", content: "" }] });
      const pad = v + AGENT_BODY_MARGIN_BYTES - frame.length;
      const body = JSON.stringify({
        run: { kind: "none" },
        files: [{ path: "/big", content: "x".repeat(pad) }],
      });
      return agentAccepts("POST", "/vms/vm-limits/exec", body);
    },
  },
};

test("every shared bound has a probe of both sides", () => {
  expect(Object.keys(PROBES).sort()).toEqual(Object.keys(SHARED_BOUNDS).sort());
  expect(AGENT_MAX_JSON_BODY_BYTES).toBe(JSON_BODY_CEILING_BYTES + AGENT_BODY_MARGIN_BYTES);
});

describe("both sides accept max and refuse max + 1", () => {
  for (const [name, bound] of Object.entries(SHARED_BOUNDS) as [
    keyof typeof SHARED_BOUNDS,
    { max: number },
  ][]) {
    test(`${name} (max ${bound.max})`, async () => {
      const p = PROBES[name];
      expect({ side: "gateway", max: await p.gateway(bound.max) }).toEqual({ side: "gateway", max: true });
      expect({ side: "gateway", over: await p.gateway(bound.max + 1) }).toEqual({
        side: "gateway",
        over: false,
      });
      expect({ side: "agent", max: await p.agent(bound.max) }).toEqual({ side: "agent", max: true });
      expect({ side: "agent", over: await p.agent(bound.max + 1) }).toEqual({ side: "agent", over: false });
    }, 60_000);
  }
});

/**
 * `sandboxd agent-token create|list|revoke`: per-agent credentials in the gateway's database
 * (gateway/agents/enrollment.ts). `create` prints an enrollment token for
 * `sandboxd agent --enroll` (single use, or `--uses N` new agents: a DaemonSet's pods), naming the region the agent is in (`--region`, default the serving
 * gateway's) and optionally pinning the URL it is reached at (`--url`); `revoke` clears an agent's key so nothing it signs is accepted and the
 * gateway stops calling it. They run in the running service through its operator socket when one
 * answers, else on the database directly (cli/operator.ts).
 */
import { parseArgs } from "node:util";
import { DIAL_URL_SCHEME } from "../contracts/agent/dial.ts";
import { AgentId } from "../contracts/agent/enroll.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { DEFAULT_ENROLLMENT_TTL_S, MAX_ENROLLMENT_USES } from "../gateway/agents/enrollment.ts";
import { defaultDataDir } from "./config.ts";
import { runOperatorOp } from "./operator.ts";
import { OPERATOR_OPS } from "./operator-ops.ts";

/** `90`, `90s`, `30m`, `2h`, `1d` -> seconds. */
export function parseTtl(value: string): number {
  const m = /^(\d+)([smhd]?)$/.exec(value);
  const n = m
    ? Number(m[1]) * { "": 1, s: 1, m: 60, h: 3600, d: 86400 }[m[2] as "" | "s" | "m" | "h" | "d"]
    : 0;
  if (!m || n <= 0)
    throw new SandboxdError("bad_request", `--ttl must be like 900, 15m, 1h or 1d; got ${value}`);
  return n;
}

export async function cmdAgentToken(args: string[]): Promise<number> {
  const [sub, ...rest] = args;
  const { values, positionals } = parseArgs({
    args: rest,
    options: {
      "data-dir": { type: "string" },
      ttl: { type: "string" },
      agent: { type: "string" },
      region: { type: "string" },
      url: { type: "string" },
      // A BYOC agent: it dials out to the gateways (no inbound port), enrolled as dial://<id>.
      dial: { type: "boolean" },
      // A tenant's own agent: it takes that tenant's sandboxes only (docs/regions.md).
      tenant: { type: "string" },
      // Enrollments of new ids the token makes (a DaemonSet's pods); default 1.
      uses: { type: "string" },
    },
    allowPositionals: true,
  });
  const dataDir = values["data-dir"] ?? defaultDataDir();
  switch (sub) {
    case "create": {
      const ttlS = values.ttl === undefined ? DEFAULT_ENROLLMENT_TTL_S : parseTtl(values.ttl);
      if (values.dial && values.url !== undefined)
        throw new SandboxdError(
          "bad_request",
          "--dial and --url exclude each other: a dial-out agent has no URL",
        );
      if (values.agent !== undefined && !AgentId.safeParse(values.agent).success)
        throw new SandboxdError("bad_request", `--agent ${values.agent} is not a valid agent id`);
      const uses = values.uses === undefined ? 1 : Number(values.uses);
      if (!/^\d+$/.test(values.uses ?? "1") || uses < 1 || uses > MAX_ENROLLMENT_USES)
        throw new SandboxdError("bad_request", `--uses must be 1-${MAX_ENROLLMENT_USES}, got ${values.uses}`);
      if (uses > 1 && values.agent !== undefined)
        throw new SandboxdError(
          "bad_request",
          "--agent and --uses exclude each other: a token for one id is single use",
        );
      const issued = await runOperatorOp(dataDir, OPERATOR_OPS, "agent-token.create", {
        ttlS,
        ...(values.agent !== undefined ? { agentId: values.agent } : {}),
        ...(values.region !== undefined ? { region: values.region } : {}),
        ...(values.url !== undefined ? { url: values.url } : {}),
        ...(values.dial ? { url: DIAL_URL_SCHEME } : {}),
        ...(values.tenant !== undefined ? { tenant: values.tenant } : {}),
        ...(uses > 1 ? { uses } : {}),
      });
      process.stderr.write(
        `created enrollment token ${issued.id}${values.agent ? ` for agent ${values.agent}` : ""} in region ${issued.region}` +
          `${values.url ? ` at ${values.url} only` : ""}${values.dial ? ", dialing out (no inbound port)" : ""}${values.tenant ? `, for tenant ${values.tenant} alone` : ""}, ` +
          `${uses > 1 ? `${uses} uses, new agent ids only` : "single use"}, expires ${issued.expiresAt}; it is shown once\n`,
      );
      // Last line: the token itself, so scripts can take it with `tail -n1`.
      process.stdout.write(`${issued.token}\n`);
      return 0;
    }
    case "list": {
      const rows = await runOperatorOp(dataDir, OPERATOR_OPS, "agent-token.list", {});
      for (const r of rows) process.stdout.write(`${JSON.stringify(r)}\n`);
      return 0;
    }
    case "revoke": {
      const id = positionals[0];
      if (!id) throw new SandboxdError("bad_request", "agent-token revoke needs an agent id");
      await runOperatorOp(dataDir, OPERATOR_OPS, "agent-token.revoke", { id });
      process.stdout.write(`revoked agent ${id}\n`);
      return 0;
    }
    default:
      throw new SandboxdError("bad_request", "usage: sandboxd agent-token create|list|revoke ...");
  }
}

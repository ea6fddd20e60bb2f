/**
 * `sandboxd key create|list|revoke`: API keys in the gateway's database, through the running
 * service's operator socket when one answers (the key works on its next request), else on the
 * database directly (cli/operator.ts).
 */
import { parseArgs } from "node:util";
import { Tier } from "../contracts/api/tiers.ts";
import { e2bKeyOf } from "../contracts/e2b/ids.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { defaultDataDir } from "./config.ts";
import { runOperatorOp } from "./operator.ts";
import { OPERATOR_OPS } from "./operator-ops.ts";

export async function cmdKey(args: string[]): Promise<number> {
  const [sub, ...rest] = args;
  const { values, positionals } = parseArgs({
    args: rest,
    options: {
      "data-dir": { type: "string" },
      tenant: { type: "string" },
      tier: { type: "string" },
      name: { type: "string" },
      region: { type: "string" },
      // Also print the key in the form E2B's SDK accepts (docs/e2b.md "Names").
      e2b: { type: "boolean" },
    },
    allowPositionals: true,
  });
  const dataDir = values["data-dir"] ?? defaultDataDir();
  switch (sub) {
    case "create": {
      if (!values.tenant) throw new SandboxdError("bad_request", "key create needs --tenant NAME");
      const parsed = Tier.safeParse(values.tier);
      if (!parsed.success) {
        throw new SandboxdError("bad_request", `key create needs --tier, one of ${Tier.options.join(", ")}`);
      }
      const issued = await runOperatorOp(dataDir, OPERATOR_OPS, "key.create", {
        tenant: values.tenant,
        tier: parsed.data,
        ...(values.name !== undefined ? { name: values.name } : {}),
        ...(values.region !== undefined ? { region: values.region } : {}),
      });
      process.stderr.write(
        `created ${issued.tier} key ${issued.keyId} for tenant ${values.tenant}${issued.region ? ` (home region ${issued.region})` : ""}; it is shown once, store it now\n`,
      );
      // Last line: the key itself, so scripts can take it with `tail -n1`; with --e2b the key in
      // E2B's form follows it (the same key, docs/e2b.md "Names").
      process.stdout.write(`${issued.key}\n`);
      if (values.e2b === true) {
        process.stderr.write("the same key in E2B's form (E2B_API_KEY) follows\n");
        process.stdout.write(`${e2bKeyOf(issued.key)}\n`);
      }
      return 0;
    }
    case "list": {
      const rows = await runOperatorOp(dataDir, OPERATOR_OPS, "key.list", {
        ...(values.tenant !== undefined ? { tenant: values.tenant } : {}),
      });
      for (const r of rows) process.stdout.write(`${JSON.stringify(r)}\n`);
      return 0;
    }
    case "revoke": {
      const id = positionals[0];
      if (!id) throw new SandboxdError("bad_request", "key revoke needs a key id or prefix");
      await runOperatorOp(dataDir, OPERATOR_OPS, "key.revoke", { id });
      process.stdout.write(`revoked ${id}\n`);
      return 0;
    }
    default:
      throw new SandboxdError("bad_request", "usage: sandboxd key create|list|revoke ...");
  }
}

/** `sandboxd key create|list|revoke`: API keys in the gateway's database. */
import { parseArgs } from "node:util";
import { Tier } from "../contracts/api/tiers.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { createKey, listKeys, revokeKey } from "../gateway/auth/keys.ts";
import { loadSecrets } from "../gateway/auth/secrets.ts";
import { defaultDataDir } from "./config.ts";
import { withGatewayDb } from "./gateway-db.ts";

export async function cmdKey(args: string[]): Promise<number> {
  const [sub, ...rest] = args;
  const { values, positionals } = parseArgs({
    args: rest,
    options: {
      "data-dir": { type: "string" },
      tenant: { type: "string" },
      tier: { type: "string" },
      name: { type: "string" },
    },
    allowPositionals: true,
  });
  const dataDir = values["data-dir"] ?? defaultDataDir();
  return withGatewayDb(dataDir, async (db) => {
    switch (sub) {
      case "create": {
        if (!values.tenant) throw new SandboxdError("bad_request", "key create needs --tenant NAME");
        const parsed = Tier.safeParse(values.tier);
        if (!parsed.success) {
          throw new SandboxdError(
            "bad_request",
            `key create needs --tier, one of ${Tier.options.join(", ")}`,
          );
        }
        const tier = parsed.data;
        const { keyPepper } = loadSecrets(dataDir);
        const issued = await createKey(db, keyPepper, {
          tenant: values.tenant,
          tier,
          name: values.name,
        });
        process.stderr.write(
          `created ${issued.tier} key ${issued.keyId} for tenant ${values.tenant}; it is shown once, store it now\n`,
        );
        // Last line: the key itself, so scripts can take it with `tail -n1`.
        process.stdout.write(`${issued.key}\n`);
        return 0;
      }
      case "list": {
        const rows = await listKeys(db, { tenant: values.tenant });
        for (const r of rows) process.stdout.write(`${JSON.stringify(r)}\n`);
        return 0;
      }
      case "revoke": {
        const id = positionals[0];
        if (!id) throw new SandboxdError("bad_request", "key revoke needs a key id or prefix");
        const ok = await revokeKey(db, id);
        if (!ok) throw new SandboxdError("not_found", `no active key ${id}`);
        process.stdout.write(`revoked ${id}\n`);
        return 0;
      }
      default:
        throw new SandboxdError("bad_request", "usage: sandboxd key create|list|revoke ...");
    }
  });
}

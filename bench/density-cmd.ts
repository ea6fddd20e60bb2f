/**
 * The `bench --density` / `bench --burst N` options of cmd.ts: parsed, bounded, run
 * (density.ts), printed as JSON. SIGINT/SIGTERM stop the density's filling early; what was
 * made is still freed and the result printed, with exit 130.
 */

import { defaultDataDir } from "../cli/config.ts";
import { intOption } from "../cli/int-option.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { DEFAULT_DENSITY_MAX, DEFAULT_RESERVE_MIB, runBurst, runDensity } from "./density.ts";

/** At most this many creates in one burst: past the tenant's session cap every create is refused. */
const MAX_BURST = 1000;
/** At most this many idle sandboxes: the agent's slot bound is far below it. */
const MAX_DENSITY = 10_000;

export async function cmdBenchDensity(
  values: { density?: boolean; burst?: string; max?: string; "reserve-mib"?: string; "data-dir"?: string },
  image: string,
  log: (m: string) => void,
): Promise<number> {
  if (values.density && values.burst !== undefined)
    throw new SandboxdError("bad_request", "--density and --burst are separate runs: give one");
  const cacheDir = values["data-dir"] ?? defaultDataDir();
  const abort = new AbortController();
  const onSignal = () => abort.abort();
  process.on("SIGINT", onSignal);
  process.on("SIGTERM", onSignal);
  try {
    const result = values.density
      ? await runDensity({
          image,
          cacheDir,
          max: intOption(values.max, "max", DEFAULT_DENSITY_MAX, 1, MAX_DENSITY),
          reserveMib: intOption(values["reserve-mib"], "reserve-mib", DEFAULT_RESERVE_MIB, 0, 1 << 24),
          signal: abort.signal,
          log,
        })
      : await runBurst({ image, cacheDir, n: intOption(values.burst, "burst", 1, 1, MAX_BURST), log });
    process.stdout.write(`${JSON.stringify(result, null, 2)}\n`);
    return abort.signal.aborted ? 130 : 0;
  } finally {
    process.off("SIGINT", onSignal);
    process.off("SIGTERM", onSignal);
  }
}

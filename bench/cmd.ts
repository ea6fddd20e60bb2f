/**
 * `sandboxd bench --image ARCHIVE [--json] [--mem MIB] [--vcpus N] [--spawns N] [--execs N]
 * [--data-dir DIR]`: the snapshot engine's figures on this host (engine.ts;
 * docs/benchmarks.md explains them). SIGINT/SIGTERM free every VM and file of the run first.
 * `--soak N`: N session create -> exec -> delete cycles through a real `up` instead (soak.ts),
 * printed as JSON: what the service holds at the start and the end, and what it left behind.
 * `--gateway [--connections N] [--seconds S] [--keys K]`: the HTTP service's own share of an exec
 * and of an authenticated read, beside the agent's own round trip and a bare app's read
 * (gateway.ts).
 * `--density [--max N] [--reserve-mib MIB]` / `--burst N`: idle sandboxes one host holds, and N
 * creates at once, through a real `up` (density.ts), printed as JSON.
 * `--http`: the same figures through a real `up` beside the engine's from the same run
 * (http.ts); `--creates`, `--suspends`, `--tunnels`, `--tunnel-mib`, `--port`,
 * `--fork-children` size it; for the engine bench, `--fork-children N` sets its fork (default 8).
 */
import { parseArgs } from "node:util";
import { defaultDataDir } from "../cli/config.ts";
import { intOption } from "../cli/int-option.ts";
import { machineSettingsOrRefuse } from "../cli/settings.ts";
import { SandboxdError } from "../contracts/errors.ts";

/** Once aborted, how long the run gets to free its VMs before we exit anyway (QEMUs die with us). */
const ABORT_GRACE_MS = 15_000;

/** The options of every bench run, parsed once; each run reads the ones it takes. */
function parseBenchValues(args: string[]) {
  return parseArgs({
    args,
    options: {
      image: { type: "string" },
      json: { type: "boolean" },
      mem: { type: "string" },
      vcpus: { type: "string" },
      spawns: { type: "string" },
      execs: { type: "string" },
      "data-dir": { type: "string" },
      soak: { type: "string" },
      gateway: { type: "boolean" },
      connections: { type: "string" },
      seconds: { type: "string" },
      keys: { type: "string" },
      density: { type: "boolean" },
      max: { type: "string" },
      "reserve-mib": { type: "string" },
      burst: { type: "string" },
      http: { type: "boolean" },
      creates: { type: "string" },
      suspends: { type: "string" },
      tunnels: { type: "string" },
      "tunnel-mib": { type: "string" },
      port: { type: "string" },
      "fork-children": { type: "string" },
    },
  }).values;
}

type BenchValues = ReturnType<typeof parseBenchValues>;

export async function cmdBench(args: string[], log: (m: string) => void): Promise<number> {
  const values = parseBenchValues(args);
  const image = values.image;
  if (!image) throw new SandboxdError("bad_request", "bench needs --image ARCHIVE");
  if (values.gateway) return await benchGateway(values, image, log);
  if (values.density || values.burst !== undefined) {
    const { cmdBenchDensity } = await import("./density-cmd.ts");
    return cmdBenchDensity(values, image, log);
  }
  if (values.soak !== undefined) return await benchSoak(values, values.soak, image, log);
  if (values.http) return await benchHttp(values, log);
  return await benchEngine(values, image, log);
}

/** `bench --gateway` (gateway.ts), printed as JSON. */
async function benchGateway(values: BenchValues, image: string, log: (m: string) => void): Promise<number> {
  const { runGatewayBench } = await import("./gateway.ts");
  const result = await runGatewayBench({
    image,
    cacheDir: values["data-dir"] ?? defaultDataDir(),
    // 64 connections: enough requests in flight to keep one core's event loop busy.
    connections: intOption(values.connections, "connections", 64, 1, 10_000),
    // 5 s per load phase: ~100k samples at the target rate, so p99 is stable.
    seconds: intOption(values.seconds, "seconds", 5, 1, 3600),
    // 200 execs each way: p50 of a ~5 ms call is then steady to a tenth of a ms.
    execs: intOption(values.execs, "execs", 200, 1, 100_000),
    // 800 keys: at 40,000 req/s (past the 20,000 goal, near a bare Hono app's rate on one core
    // here) each key sends 50 a second, half the API's limit of 100, so the limit never caps the figure.
    keys: intOption(values.keys, "keys", 800, 1, 100_000),
    log,
  });
  process.stdout.write(`${JSON.stringify(result, null, 2)}\n`);
  return 0;
}

/** `bench --soak N` (soak.ts), printed as JSON; SIGINT/SIGTERM stop it early. */
async function benchSoak(
  values: BenchValues,
  cycles: string,
  image: string,
  log: (m: string) => void,
): Promise<number> {
  const { runSoak } = await import("./soak.ts");
  const abort = new AbortController();
  const onSignal = () => abort.abort();
  process.on("SIGINT", onSignal);
  process.on("SIGTERM", onSignal);
  try {
    const result = await runSoak({
      cycles: intOption(cycles, "soak", 1, 1, 1_000_000),
      image,
      cacheDir: values["data-dir"] ?? defaultDataDir(),
      signal: abort.signal,
      log,
    });
    process.stdout.write(`${JSON.stringify(result, null, 2)}\n`);
    // Stopped early: what ran is printed, and the exit says it was cut short.
    return abort.signal.aborted ? 130 : 0;
  } finally {
    process.off("SIGINT", onSignal);
    process.off("SIGTERM", onSignal);
  }
}

/** The engine's own figures (engine.ts): a table, or JSON with --json; SIGINT/SIGTERM free what it made. */
async function benchEngine(values: BenchValues, image: string, log: (m: string) => void): Promise<number> {
  const machine = machineSettingsOrRefuse();
  if (!machine) return 2;
  const { runBench, FORK_CHILDREN } = await import("./engine.ts");
  const { isInterrupted } = await import("./engine-scope.ts");
  const { MAX_FORK_CHILDREN } = await import("../agent/snapshot/fork.ts");
  const abort = new AbortController();
  let exitTimer: ReturnType<typeof setTimeout> | undefined;
  const onSignal = (sig: NodeJS.Signals) => {
    if (abort.signal.aborted) return;
    log(`${sig}: stopping the benchmark`);
    abort.abort();
    exitTimer = setTimeout(() => process.exit(130), ABORT_GRACE_MS);
  };
  process.on("SIGINT", onSignal);
  process.on("SIGTERM", onSignal);
  try {
    const result = await runBench({
      dataDir: values["data-dir"] ?? defaultDataDir(),
      image,
      // 256 MiB, 1 vCPU: the shape every snapshot figure in docs/benchmarks.md was measured at.
      memMib: intOption(values.mem, "mem", 256, 64, 65536),
      vcpus: intOption(values.vcpus, "vcpus", 1, 1, 64),
      // 20 spawns: p95 is then the second largest, not just the maximum.
      spawns: intOption(values.spawns, "spawns", 20, 1, 1000),
      execs: intOption(values.execs, "execs", 200, 1, 100_000),
      forkChildren: intOption(values["fork-children"], "fork-children", FORK_CHILDREN, 1, MAX_FORK_CHILDREN),
      accelSetting: machine.accel,
      host: machine.host,
      signal: abort.signal,
      log,
    });
    if (values.json) process.stdout.write(`${JSON.stringify(result, null, 2)}\n`);
    else {
      const { formatTable } = await import("./report.ts");
      process.stdout.write(`${formatTable(result)}\n`);
    }
    return 0;
  } catch (err) {
    if (isInterrupted(err)) return 130;
    throw err;
  } finally {
    clearTimeout(exitTimer);
    process.off("SIGINT", onSignal);
    process.off("SIGTERM", onSignal);
  }
}

/** `bench --http` (http.ts), printed as JSON; SIGINT/SIGTERM stop it and free what it made. */
async function benchHttp(
  values: Record<string, string | boolean | undefined>,
  log: (m: string) => void,
): Promise<number> {
  const { runHttpBench, defaultForkChildren } = await import("./http.ts");
  const str = (k: string) => values[k] as string | undefined;
  const abort = new AbortController();
  const onSignal = () => abort.abort();
  process.on("SIGINT", onSignal);
  process.on("SIGTERM", onSignal);
  try {
    const result = await runHttpBench({
      image: str("image") as string,
      cacheDir: str("data-dir") ?? defaultDataDir(),
      memMib: intOption(str("mem"), "mem", 256, 64, 65536),
      vcpus: intOption(str("vcpus"), "vcpus", 1, 1, 64),
      // bench's defaults (20 creates: p95 is then the second largest, not just the maximum), and
      // fewer of the rarer operations: the whole run (the engine twice, the service once) takes
      // ~2 min under TCG on a loaded 2-core host.
      creates: intOption(str("creates") ?? str("spawns"), "creates", 20, 1, 1000),
      execs: intOption(str("execs"), "execs", 200, 1, 100_000),
      suspends: intOption(str("suspends"), "suspends", 5, 1, 1000),
      tunnels: intOption(str("tunnels"), "tunnels", 20, 1, 1000),
      // 16 MiB: long enough that the WebSocket's open is a small part of the transfer.
      tunnelMib: intOption(str("tunnel-mib"), "tunnel-mib", 16, 1, 1024),
      port: intOption(str("port"), "port", 8080, 1, 65535),
      forkChildren: intOption(str("fork-children"), "fork-children", defaultForkChildren(), 1, 64),
      signal: abort.signal,
      log,
    });
    process.stdout.write(`${JSON.stringify(result, null, 2)}\n`);
    return 0;
  } catch (err) {
    if (abort.signal.aborted) return 130;
    throw err;
  } finally {
    process.off("SIGINT", onSignal);
    process.off("SIGTERM", onSignal);
  }
}

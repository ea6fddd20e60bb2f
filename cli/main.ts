/**
 * The sandboxd command line. `bin/sandboxd` installs what is missing and then runs this file.
 * Commands parse their arguments here and call into agent/ (no logic of their own).
 */
import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";
import { describeError, SandboxdError } from "../contracts/errors.ts";
import { formatLogLine, type LogFields, type LogFormat, withRequestFields } from "../contracts/log.ts";
import { buildVersion } from "./build-stamp.ts";
import { defaultDataDir, REPO_ROOT } from "./config.ts";
import { intOption } from "./int-option.ts";
import { logFormat, machineSettingsOrRefuse, quiet } from "./settings.ts";

const USAGE = `usage: sandboxd <command> [options]

commands:
  up [--port PORT] [--host ADDR] [--data-dir DIR] [--public-url URL] [--no-catalog | --catalog ID,...]
        run the service: the HTTP gateway (both API APIs) and one host agent in this
        process; state in PGlite under the data dir, or PostgreSQL when DATABASE_URL is set;
        builds the catalog's templates (python, base; --catalog: those named) on first start
  gateway [--port PORT] [--host ADDR] [--data-dir DIR] [--public-url URL] [--region R] [--no-catalog | --catalog ID,...]
        run the HTTP gateway alone; it places each tenant's sandboxes on the agents of the
        tenant's home region (live, with room, least-loaded first); R is the home of tenants
        created through it without --region; DATABASE_URL as for up
  agent --gateway URL [--enroll TOKEN] [--listen HOST:PORT] [--advertise URL | --dial URL,...]
        [--region R] [--id ID] [--slots N] [--data-dir DIR] [--no-catalog | --catalog ID,...]
        run one host agent: serve the agent API on --listen (default 127.0.0.1:7070), heartbeat
        to the gateway at URL as reachable at --advertise; builds the catalog's templates.
        The first start enrolls with a one-time token (--enroll, from agent-token create) and
        keeps the agent's own key in <data>/agent/credentials.json; later starts need no token;
        --dial (an agent enrolled with agent-token create --dial) opens an encrypted link to each
        gateway URL and is reached only through it: no inbound port (docs/regions.md)
  run --image ARCHIVE [--mem MIB] [--vcpus N] [--timeout S] [-i] [--data-dir DIR] [-- CMD [ARG...]]
        import an OCI image archive (docker save tar, oci-archive tar or OCI layout dir), boot a
        microVM from it, run CMD (default: the image's Entrypoint+Cmd) as the image's config
        says, print its output and exit with its exit code; -i passes our stdin to it
  bench --image ARCHIVE [--json] [--mem MIB] [--vcpus N] [--spawns N] [--execs N]
        [--fork-children N] [--data-dir DIR]
        measure boot, spawn (next to a bare QEMU restore), exec, fork (N children, up to 128,
        next to N bare restores at once), suspend/resume and idle memory on this host; removes
        every VM and file it made (docs/benchmarks.md)
  bench --soak N --image ARCHIVE [--data-dir DIR]
        N session create -> exec -> delete cycles through a real up; prints the service's RSS,
        fds, /dev/shm and data-dir use at the start and the end, and any leftovers (JSON)
  bench --http --image ARCHIVE [--creates N] [--execs N] [--suspends N] [--tunnels N]
        [--tunnel-mib N] [--fork-children N] [--port P] [--mem MIB] [--vcpus N] [--data-dir DIR]
        the engine's figures, then the same through a real up (create, exec, fork, suspend,
        resume, delete, connect-URL tunnel), each with the service's share (JSON)
  doctor [--build] [--data-dir DIR]
        check the host; --build also builds missing guest artifacts
  key create --tenant NAME --tier TIER [--name LABEL] [--region R] [--e2b] [--data-dir DIR]
  key list [--tenant NAME] [--data-dir DIR]
  key revoke KEY-ID [--data-dir DIR]
        API keys (svc_<tier>[_<region>]_<id>_<secret>) in the gateway database: PGlite in the data dir, or
        PostgreSQL when DATABASE_URL is set; create prints the new key as its last line. While
        up or gateway runs they go through its operator socket (<data>/operator/sandboxd.sock)
        and take effect at once; revoke also revokes the connect URLs the key minted; a new
        tenant is at home in --region R (default: the running gateway's --region), fixed,
        and its keys name that region (an edge routes them by it: docs/edge.md)
  usage --tenant NAME [--from ISO] [--to ISO] [--by sandbox|day] [--json] [--data-dir DIR]
        a tenant's metered usage over [from, to) (default: this UTC month until now): seconds
        running, paused and suspended, cpu_core_hours, ram_gb_hours, disk_gb_hours and
        snapshot_gb_months, in all, per sandbox (with how each ended) or per UTC day; a table,
        or JSON with --json; database as for key (SQL views: docs/quotas-and-usage.md)
  agent-token create [--ttl 1h] [--agent ID | --uses N] [--region R] [--url URL | --dial] [--tenant T] [--data-dir DIR]
  agent-token list [--data-dir DIR]
  agent-token revoke AGENT-ID [--data-dir DIR]
        per-agent credentials in the gateway database: create prints a one-time enrollment
        token (sbxe_..., default life 1h; --agent binds it to that id and re-keys it; --uses N
        makes it enroll up to N new ids, never a known one: a DaemonSet's pods) as its last
        line; the agent it enrolls is in region R for good (default: the running gateway's
        --region, else local) and, with --url, reached at URL only; revoke makes the gateway
        refuse the agent's heartbeats and stop calling it
  migrate [--data-dir DIR]
        apply the database migrations and exit (PostgreSQL when DATABASE_URL is set, under the
        advisory lock starting gateways take; else the data dir's PGlite); for gateways run with
        SANDBOXD_MIGRATE=off, which refuse a schema older than themselves
  fleet list [--data-dir DIR]
  fleet cordon|uncordon AGENT-ID [--data-dir DIR]
  fleet drain AGENT-ID [--timeout 1h] [--data-dir DIR]
        the agents as the gateway sees them (live, stale, lost, revoked; cordoned; live
        sandboxes), one JSON line each; cordon keeps new sandboxes off an agent, drain cordons
        it and waits until its sandboxes have ended (exit 1 if some remain at --timeout)
  up, gateway and agent also take the operator settings, each a flag or an environment
  variable (flag first, then environment, then --config FILE: JSON or KEY=VALUE lines with the
  environment names), e.g. --session-idle-ttl S / SANDBOXD_SESSION_IDLE_TTL; the list with
  defaults is in the README ("Operator settings"); an invalid value exits 2
  sbx create|ls|info|exec|cp|shell|fork|suspend|resume|rm|snapshot|snapshots|snapshot-rm|restore|
      timeout|egress [ARGS...] [--json]
  template ls|bake|rm [ARGS...] [--json]
        the client: sandboxes and templates on any sandboxd server ($SANDBOXD_URL or --url,
        default http://127.0.0.1:8080) with an API key ($SANDBOXD_API_KEY or --api-key), through
        the TypeScript SDK. sbx exec streams the command's output and exits with its exit code;
        sbx shell is an interactive terminal; sbx cp copies files both ways (ID:/path, - for
        stdin/stdout); sbx snapshot keeps a sandbox's state, sbx restore rolls one back to it.
        Each has --help; exit 2 on a usage error, 1 when the server refuses
        (printed as code: message)
  bun ARGS...
        run the Bun this launcher installed (the repository's tools, e.g.
        bin/sandboxd bun tests/fixtures/images.ts busybox /tmp/img.tar)
  test [--quick] [--jobs N] [FILE-FILTER...]
        type check, lint and run the test suite, several files at once (the README's test
        command); --quick: only the unit and in-process suites (no VM, no up); a filter runs
        only the matching files (no type check or lint)
  --version`;

const VERSION: string = JSON.parse(readFileSync(`${REPO_ROOT}/package.json`, "utf8")).version;
/** What the serving commands report as their version: the package version and the commit. */
const buildStamp = () => buildVersion(REPO_ROOT, VERSION);

/** `SANDBOXD_LOG_FORMAT` (checked with the other settings by the serving commands): text or json. */
const LOG_FORMAT: LogFormat = logFormat();

function log(msg: string, fields?: LogFields): void {
  if (quiet()) return;
  const line = formatLogLine(LOG_FORMAT, msg, withRequestFields(fields));
  if (line !== undefined) process.stderr.write(`${line}\n`);
}

async function cmdRun(args: string[]): Promise<number> {
  const { values, positionals } = parseArgs({
    args,
    options: {
      image: { type: "string" },
      mem: { type: "string" },
      vcpus: { type: "string" },
      timeout: { type: "string" },
      interactive: { type: "boolean", short: "i" },
      "data-dir": { type: "string" },
    },
    allowPositionals: true,
  });
  if (!values.image) throw new SandboxdError("bad_request", "run needs --image ARCHIVE");
  const machine = machineSettingsOrRefuse();
  if (!machine) return 2;
  const { runOnce } = await import("../agent/run.ts");
  const stdin = values.interactive ? Buffer.from(await Bun.stdin.arrayBuffer()) : undefined;
  const abort = new AbortController();
  const onSignal = () => abort.abort();
  process.once("SIGINT", onSignal);
  process.once("SIGTERM", onSignal);
  const res = await runOnce({
    dataDir: values["data-dir"] ?? defaultDataDir(),
    image: values.image,
    cmd: positionals,
    // 256 MiB: the size the snapshot figures in docs/benchmarks.md were measured at; plenty for a shell.
    memMib: intOption(values.mem, "mem", 256, 64, 65536),
    vcpus: intOption(values.vcpus, "vcpus", 1, 1, 64),
    // 30 s: the API's default exec timeout (docs/limits.md "Public API limits").
    timeoutSec: intOption(values.timeout, "timeout", 30, 1, 86400),
    stdin,
    log,
    onStdout: (b) => process.stdout.write(b),
    onStderr: (b) => process.stderr.write(b),
    signal: abort.signal,
    accelSetting: machine.accel,
    host: machine.host,
  });
  log(
    `${res.accel}: import ${res.timings.importMs.toFixed(0)} ms, boot ${res.timings.bootMs.toFixed(0)} ms, ` +
      `exec ${res.timings.execMs.toFixed(0)} ms, total ${res.timings.totalMs.toFixed(0)} ms`,
  );
  if (res.timedOut) log(`command timed out after ${values.timeout ?? 30} s`);
  if (res.exitCode !== null) return res.exitCode;
  // Killed by a signal: exit as a shell reports it.
  return 128 + (res.signal ?? 9);
}

async function main(argv: string[]): Promise<number> {
  const [cmd, ...rest] = argv;
  switch (cmd) {
    case "run":
      return cmdRun(rest);
    case "up": {
      const { cmdUp } = await import("./up.ts");
      return cmdUp(rest, buildStamp(), log);
    }
    case "gateway": {
      const { cmdGateway } = await import("./serve.ts");
      return cmdGateway(rest, buildStamp(), log);
    }
    case "agent": {
      const { cmdAgent } = await import("./serve.ts");
      return cmdAgent(rest, buildStamp(), log);
    }
    case "bench": {
      const { cmdBench } = await import("../bench/cmd.ts");
      return cmdBench(rest, log);
    }
    case "doctor": {
      const { values } = parseArgs({
        args: rest,
        options: { build: { type: "boolean" }, "data-dir": { type: "string" } },
      });
      const { doctor } = await import("./doctor.ts");
      const machine = machineSettingsOrRefuse();
      if (!machine) return 2;
      return doctor(values["data-dir"] ?? defaultDataDir(), { build: values.build ?? false, machine });
    }
    case "key": {
      const { cmdKey } = await import("./keys.ts");
      return cmdKey(rest);
    }
    case "usage": {
      const { cmdUsage } = await import("./usage.ts");
      return cmdUsage(rest);
    }
    case "agent-token": {
      const { cmdAgentToken } = await import("./agent-tokens.ts");
      return cmdAgentToken(rest);
    }
    case "migrate": {
      const { cmdMigrate } = await import("./migrate.ts");
      return cmdMigrate(rest);
    }
    case "fleet": {
      const { cmdFleet } = await import("./fleet.ts");
      return cmdFleet(rest);
    }
    case "sbx":
    case "template": {
      const { runClient } = await import("./client/index.ts");
      const { processCtx } = await import("./client/context.ts");
      const code = await runClient(cmd, rest, processCtx());
      // Everything written reaches a pipe before the exit (process.exit drops what is queued).
      await new Promise<void>((done) => process.stdout.write("", () => done()));
      return code;
    }
    case "test": {
      const { runTests } = await import("./testing/run.ts");
      return runTests(rest);
    }
    case "--version":
    case "version":
      process.stdout.write(`sandboxd ${buildStamp()}\n`);
      return 0;
    case undefined:
    case "help":
    case "--help":
    case "-h":
      process.stdout.write(`${USAGE}\n`);
      return 0;
    default:
      process.stderr.write(`sandboxd: unknown command ${cmd}\n${USAGE}\n`);
      return 2;
  }
}

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (err: unknown) => {
    process.stderr.write(`sandboxd: error: ${describeError(err)}\n`);
    const details = err instanceof SandboxdError ? err.details : undefined;
    if (details?.console) process.stderr.write(`--- guest console (tail) ---\n${String(details.console)}\n`);
    // 125: the runner itself failed, as `docker run` reports it (the command's codes stay 0-124, 126+).
    process.exit(125);
  },
);

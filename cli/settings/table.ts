/**
 * The one table of operator settings: every environment variable, flag and `--config` key that
 * `up`, `gateway`, `agent` and the CLI read, with its default and range. The parser (parse.ts),
 * the typed views the code receives (views.ts) and the README's table (readme.ts) all come from
 * it. Every default is the using code's own constant, so an unset setting changes nothing.
 */
import { parseAllowInternal } from "../../agent/egress/fence.ts";
import { DEFAULT_IMAGE_CACHE_BYTES } from "../../agent/image/evict.ts";
import { DEFAULT_MAX_PULL_BYTES, parseRegistryList } from "../../agent/image/pull.ts";
import { DEFAULT_UID_RANGE } from "../../agent/qemu/uids.ts";
import { DEFAULT_IDLE_PAUSE_MS } from "../../agent/sandbox/manager.ts";
import { MAX_PRELAUNCH_PER_TEMPLATE } from "../../agent/sandbox/prelaunch-pool.ts";
import { MAX_CONCURRENT_BUILDS } from "../../agent/sandbox/templates.ts";
import { DEFAULT_FORK_METHOD, FORK_METHODS } from "../../agent/snapshot/fork-method.ts";
import { DEFAULT_BRINGUP_TIMEOUT_MS, DEFAULT_READY_TIMEOUT_MS } from "../../agent/snapshot/template.ts";
import { RESTORE_READY_TIMEOUT_MS } from "../../agent/snapshot/vm.ts";
import {
  DEFAULT_LIMITS,
  FORK_CAP_BY_TIER,
  IDLE_ACTIONS,
  MAX_IDLE_TIMEOUT_S,
  REAPER_INTERVAL_S,
  SANDBOX_QUOTA_BY_TIER,
  SESSION_CAP_PER_TENANT,
  SESSION_IDLE_TTL_S,
} from "../../contracts/api/limits.ts";
import { DEFAULT_DISK_RESERVE_BYTES } from "../../contracts/disk-space.ts";
import { DEFAULT_DRAIN_DELAY_MS, DEFAULT_DRAIN_TIMEOUT_MS } from "../../contracts/drain.ts";
import { LOG_FORMATS } from "../../contracts/log.ts";
import { HEAP_STATS_ENV } from "../heap-stats.ts";

/**
 * Where a setting is used: the gateway, the host agent, or the CLI process itself. Health shows
 * a process's gateway and agent settings, never a secret nor a place on disk (`reported: false`).
 */
export type Scope = "gateway" | "agent" | "cli";

interface SettingBase {
  /** The environment variable and the key in a config file. */
  env: string;
  /** The command-line flag, without `--`; none for secrets (a flag shows in `ps`). */
  flag?: string;
  scope: Scope;
  doc: string;
  /**
   * False: left out of health's `settings`, which shows the gateway's limits and the agent's
   * timing, never a secret, an address or a path.
   */
  reported?: false;
  /** An empty value means unset (the default) rather than a refusal, as these always have. */
  emptyIsUnset?: true;
}

export interface NumberSetting extends SettingBase {
  def: number;
  min: number;
  max: number;
  unit: "seconds" | "milliseconds" | "count" | "bytes";
}

/** A setting that names one of a few words (an action), not a number. */
export interface ChoiceSetting extends SettingBase {
  def: string;
  choices: readonly string[];
  unit: "choice";
}

/**
 * Free text: a URL, a path, a list. Unset (or empty) is `""`, which each user reads as "none"
 * (`defText` says what that means). `check` returns the refusal for a malformed value.
 */
export interface TextSetting extends SettingBase {
  def: "";
  defText: string;
  rangeText: string;
  unit: "text";
  check?: (value: string) => string | undefined;
}

export type SettingSpec = NumberSetting | ChoiceSetting | TextSetting;

/** One day: no deadline or interval of ours is meant to be longer; a larger value is a typo. */
const DAY_S = 24 * 3600;
/** The most of anything countable a setting may ask for: far above one host or tenant's scale. */
const MAX_COUNT = 1_000_000;
/** The sandboxes API tiers, whose sandbox quotas and fork caps are settings (the sessions API has neither). */
export const B_TIERS = ["demo", "pro", "enterprise"] as const;

/** Safe-integer bytes: beyond 2^53 a count of bytes stops being exact. */
const MAX_BYTES = Number.MAX_SAFE_INTEGER;

/** The message of what `parse` throws (a SandboxdError naming the setting), or undefined. */
function refusal(parse: () => unknown): string | undefined {
  try {
    parse();
    return undefined;
  } catch (err) {
    return err instanceof Error ? err.message : String(err);
  }
}

/** An operator grant of internal ranges (`cidr,...`, none by default), parsed as the fence does. */
function internalRanges(env: string, flag: string, doc: string): TextSetting {
  return {
    env,
    flag,
    scope: "agent",
    reported: false,
    def: "",
    defText: "none",
    rangeText: "cidr,...",
    unit: "text",
    check: (v) => refusal(() => parseAllowInternal(v, "an entry")),
    doc,
  };
}

/** A check that a setting is a URL of one of `schemes` (e.g. "http:"). */
function urlOf(...schemes: string[]): (v: string) => string | undefined {
  const names = schemes.map((p) => `${p.slice(0, -1)}://`).join(", ");
  return (v) => {
    let u: URL;
    try {
      u = new URL(v);
    } catch {
      return "not a URL";
    }
    return schemes.includes(u.protocol) ? undefined : `not ${names}`;
  };
}

const checkPublicUrl = urlOf("http:", "https:", "ws:", "wss:");
const checkPeerUrl = urlOf("http:", "https:");
/** A host name's labels: at most 253 characters (DNS's bound on a name). */
const checkDomain = (v: string): string | undefined =>
  v.length <= 253 && /^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$/i.test(v)
    ? undefined
    : "not a DNS name";

export const SETTINGS: readonly SettingSpec[] = [
  {
    env: "SANDBOXD_SESSION_IDLE_TTL",
    flag: "session-idle-ttl",
    scope: "gateway",
    def: SESSION_IDLE_TTL_S,
    min: 1,
    max: 7 * DAY_S,
    unit: "seconds",
    doc: "a session with no exec for this long is reclaimed; later calls get 410 gone",
  },
  {
    env: "SANDBOXD_REAPER_INTERVAL",
    flag: "reaper-interval",
    scope: "gateway",
    def: REAPER_INTERVAL_S,
    min: 1,
    max: DAY_S,
    unit: "seconds",
    doc: "how often each gateway looks for idle sessions and sandboxes (the most a reclaim or idle suspend runs late)",
  },
  {
    env: "SANDBOXD_IDLE_TIMEOUT",
    flag: "idle-timeout",
    scope: "gateway",
    def: DEFAULT_LIMITS.idleTimeoutS,
    min: 0,
    // The same week as a sandbox's own idle_timeout_seconds may ask for.
    max: MAX_IDLE_TIMEOUT_S,
    unit: "seconds",
    doc: "the idle lifetime of sandboxes created without idle_timeout_seconds; 0: none (they run until deleted)",
  },
  {
    env: "SANDBOXD_IDLE_ACTION",
    flag: "idle-action",
    scope: "gateway",
    def: DEFAULT_LIMITS.idleAction,
    choices: IDLE_ACTIONS,
    unit: "choice",
    doc: "what SANDBOXD_IDLE_TIMEOUT does to an idle sandbox (one created without idle_action): suspend it (its next call resumes it) or delete it",
  },
  {
    env: "SANDBOXD_SESSION_CAP",
    flag: "session-cap",
    scope: "gateway",
    def: SESSION_CAP_PER_TENANT,
    min: 1,
    max: MAX_COUNT,
    unit: "count",
    doc: "live sessions per tenant; a create beyond it is 429",
  },
  ...B_TIERS.map(
    (tier): SettingSpec => ({
      env: `SANDBOXD_QUOTA_${tier.toUpperCase()}`,
      flag: `quota-${tier}`,
      scope: "gateway",
      def: SANDBOX_QUOTA_BY_TIER[tier],
      min: 0,
      max: MAX_COUNT,
      unit: "count",
      doc: `running sandboxes per ${tier} tenant; beyond it 429 quota_exceeded`,
    }),
  ),
  ...B_TIERS.map(
    (tier): SettingSpec => ({
      env: `SANDBOXD_FORK_CAP_${tier.toUpperCase()}`,
      flag: `fork-cap-${tier}`,
      scope: "gateway",
      def: FORK_CAP_BY_TIER[tier],
      min: 1,
      // A fork's children share the parent's host: more than 1024 in one call is no fan-out one
      // host can restore.
      max: 1024,
      unit: "count",
      doc: `children one fork call may ask for, ${tier} keys`,
    }),
  ),
  {
    env: "SANDBOXD_BOOT_TIMEOUT",
    flag: "boot-timeout",
    scope: "agent",
    def: DEFAULT_BRINGUP_TIMEOUT_MS / 1000,
    min: 1,
    max: DAY_S,
    unit: "seconds",
    doc: "a template build's cold boot, QEMU start to the guest agent's first answer",
  },
  {
    env: "SANDBOXD_READY_TIMEOUT",
    flag: "ready-timeout",
    scope: "agent",
    def: DEFAULT_READY_TIMEOUT_MS / 1000,
    min: 1,
    max: DAY_S,
    unit: "seconds",
    doc: "a template's ready command when the template names no timeout",
  },
  {
    env: "SANDBOXD_RESTORE_TIMEOUT",
    flag: "restore-timeout",
    scope: "agent",
    def: RESTORE_READY_TIMEOUT_MS / 1000,
    min: 1,
    max: DAY_S,
    unit: "seconds",
    doc: "a restore (create from a template, fork child, resume) to the guest's first answer",
  },
  {
    env: "SANDBOXD_BUILD_SLOTS",
    flag: "build-slots",
    scope: "agent",
    def: MAX_CONCURRENT_BUILDS,
    min: 1,
    // Each build boots a VM and runs the image tools: 64 at once is beyond any host we know.
    max: 64,
    unit: "count",
    doc: "template builds that run at once on one agent; later ones wait (Pending)",
  },
  {
    env: "SANDBOXD_IDLE_PAUSE_MS",
    flag: "idle-pause-ms",
    scope: "agent",
    def: DEFAULT_IDLE_PAUSE_MS,
    // Below 10 ms a VM would be stopped between the requests of one burst.
    min: 10,
    max: DAY_S * 1000,
    unit: "milliseconds",
    doc: "an idle VM's vCPUs are stopped after this long (restarted by the next call)",
  },
  {
    env: "SANDBOXD_FORK_METHOD",
    flag: "fork-method",
    scope: "agent",
    def: DEFAULT_FORK_METHOD,
    choices: FORK_METHODS,
    unit: "choice",
    doc: "how a fork copies its running parent's memory: snapshot (QEMU background snapshot, the parent stops ~10-50 ms; the agent sets vm.unprivileged_userfaultfd=1, else falls back to stop-copy), stop-copy (the parent stops for the whole copy), precopy (live precopy; not for TCG hosts)",
  },
  // What each process needs at start: where it keeps its state, and the gateway's secrets.
  {
    env: "SANDBOXD_DATA_DIR",
    flag: "data-dir",
    scope: "cli",
    reported: false,
    def: "",
    defText: "/var/lib/sandboxd as root, else $XDG_DATA_HOME/sandboxd (~/.local/share/sandboxd)",
    rangeText: "a directory",
    unit: "text",
    doc: "where sandboxd keeps images, guest artifacts, VM directories, secrets and (PGlite) its database",
  },
  {
    env: "DATABASE_URL",
    scope: "gateway",
    reported: false,
    def: "",
    defText: "none: PGlite under the data directory",
    rangeText: "a PostgreSQL URL",
    unit: "text",
    doc: "the gateway's PostgreSQL; gateways sharing one are replicas of one service",
  },
  {
    env: "SANDBOXD_LOG_FORMAT",
    scope: "gateway",
    reported: false,
    def: "text",
    choices: LOG_FORMATS,
    unit: "choice",
    doc: "the serving processes' log lines (the environment only: lines are written before flags and config files are read): `sandboxd: <text>`, or one JSON object a line (time, level, msg, request_id, tenant, sandbox, agent, and an access line per gateway request)",
  },
  {
    env: "SANDBOXD_DRAIN_DELAY",
    flag: "drain-delay",
    scope: "gateway",
    def: DEFAULT_DRAIN_DELAY_MS / 1000,
    min: 0,
    max: 60,
    unit: "seconds",
    doc: "on SIGTERM, how long /readyz answers 503 before the process waits for its requests in flight (a load balancer's time to notice); gateway and agent",
  },
  {
    env: "SANDBOXD_DRAIN_TIMEOUT",
    flag: "drain-timeout",
    scope: "gateway",
    def: DEFAULT_DRAIN_TIMEOUT_MS / 1000,
    min: 1,
    max: 3600,
    unit: "seconds",
    doc: "on SIGTERM, the longest the process waits for its requests in flight (an exec ends, a stream is cut) before it stops; gateway and agent",
  },
  {
    env: "SANDBOXD_DATABASE_LISTEN_URL",
    flag: "database-listen-url",
    scope: "gateway",
    reported: false,
    def: "",
    defText: "none: DATABASE_URL",
    rangeText: "a PostgreSQL URL",
    unit: "text",
    doc: "a direct PostgreSQL connection for the gateway's LISTEN, when DATABASE_URL goes through a transaction-mode pooler (which cannot hold one)",
  },
  {
    env: "SANDBOXD_MIGRATE",
    flag: "migrate",
    scope: "gateway",
    reported: false,
    def: "on-start",
    choices: ["on-start", "off"],
    unit: "choice",
    doc: "on-start: a gateway applies the migrations when it starts (replicas starting together wait for each other: an advisory lock); off: it refuses to start on a schema older than itself, for fleets that run `sandboxd migrate` as a step of their own",
  },
  {
    env: "SANDBOXD_PUBLIC_URL",
    flag: "public-url",
    scope: "gateway",
    reported: false,
    def: "",
    defText: "none: connect URLs follow each request's scheme and host",
    rangeText: "an http(s):// or ws(s):// URL",
    unit: "text",
    check: checkPublicUrl,
    doc: "the base of connect URLs (`wss://` for an `https://` one)",
  },
  {
    env: "SANDBOXD_E2B_DOMAIN",
    flag: "e2b-domain",
    scope: "gateway",
    reported: false,
    def: "",
    defText: "none: E2B's data plane only under `/e2b/envd`",
    rangeText: "a DNS name (letters, digits, `-`, `.`)",
    unit: "text",
    check: checkDomain,
    doc: "the domain of E2B's sandbox hosts: a request to `<port>-<id>.<domain>` goes to sandbox `<id>`'s envd or guest port (docs/e2b.md \"Data plane\")",
  },
  {
    env: "SANDBOXD_PEER_URL",
    flag: "peer-url",
    scope: "gateway",
    reported: false,
    def: "",
    defText: "none: its dial-out agents' links serve this gateway only",
    rangeText: "an http(s):// URL",
    unit: "text",
    check: checkPeerUrl,
    doc: 'this gateway\'s URL as the other gateways of its region reach it: they relay calls to the dial-out agents linked here (docs/regions.md "Gateways behind one address")',
  },
  ...(
    [
      ["SANDBOXD_KEY_PEPPER", "key-pepper", "the key that hashes API keys (only a keyed hash is stored)"],
      ["SANDBOXD_CONNECT_SECRET", "connect-secret", "the key that signs connect URLs"],
      [
        "SANDBOXD_AGENT_SECRET",
        "agent-secret",
        "the gateway's key from which each agent's own key is derived",
      ],
    ] as const
  ).map(
    ([env, file, what]): SettingSpec => ({
      env,
      scope: "gateway",
      reported: false,
      def: "",
      defText: `generated once in <data>/secrets/${file}`,
      rangeText: "a secret",
      unit: "text",
      doc: what,
    }),
  ),
  {
    env: "SANDBOXD_METRICS_TOKEN",
    scope: "gateway",
    reported: false,
    def: "",
    defText: "none: no /metrics endpoint",
    rangeText: "a secret",
    unit: "text",
    doc: 'the bearer token `GET /metrics` (Prometheus text) asks of a scraper, on the gateway and on each agent (docs/operations.md "Metrics")',
  },
  {
    env: "SANDBOXD_OTLP_ENDPOINT",
    scope: "gateway",
    reported: false,
    def: "",
    defText: "none: spans are not exported (trace ids still name log lines)",
    rangeText: "an http(s):// URL",
    unit: "text",
    check: checkPeerUrl,
    doc: "an OpenTelemetry collector's OTLP/HTTP base URL: the gateway's and each agent's spans are POSTed as JSON to `<url>/v1/traces` (docs/operations.md \"Tracing\")",
  },
  {
    env: "SANDBOXD_ENROLL_TOKEN",
    scope: "agent",
    reported: false,
    def: "",
    defText: "none: enroll with --enroll",
    rangeText: "a secret",
    unit: "text",
    doc: "an enrollment token the agent redeems only when its data dir holds no credentials (its first start), so one `agent-token create --uses N` token in every pod's environment enrolls each host once; `--enroll` enrolls on every start (docs/kubernetes.md)",
  },
  // The agent's host: registries, egress, disk budgets, the accelerator and the jail.
  {
    env: "SANDBOXD_EGRESS_DEFAULT",
    flag: "egress-default",
    scope: "agent",
    reported: false,
    def: "deny",
    choices: ["deny", "allow"],
    unit: "choice",
    doc: "the egress of sandboxes created without `egress`: nothing outside (deny) or the internet (allow)",
  },
  internalRanges(
    "SANDBOXD_EGRESS_ALLOW_INTERNAL",
    "egress-allow-internal",
    "internal ranges (loopback, private, link-local, metadata, the host's own) sandboxes may reach; no other internal address is reachable (registry pulls have their own: SANDBOXD_REGISTRY_ALLOW_INTERNAL)",
  ),
  // Its own setting: allowing a private registry for bakes must not open it to every tenant's
  // code, and a range opened to sandboxes must not become a place bakes pull from.
  internalRanges(
    "SANDBOXD_REGISTRY_ALLOW_INTERNAL",
    "registry-allow-internal",
    "internal ranges registry pulls (bakes) may reach, apart from what sandboxes may reach; no other internal address is reachable by a pull",
  ),
  {
    env: "SANDBOXD_SHARED_REGISTRIES",
    flag: "shared-registries",
    scope: "agent",
    reported: false,
    def: "",
    defText: "none",
    rangeText: "host[:port],...",
    unit: "text",
    check: (v) => refusal(() => parseRegistryList(v, "an entry")),
    doc: "registries bakes pull from with SANDBOXD_REGISTRY_AUTH (a bake's own `registry_auth` elsewhere); each bake is still authorized by the registry",
  },
  {
    env: "SANDBOXD_REGISTRY_AUTH",
    flag: "registry-auth",
    scope: "agent",
    reported: false,
    def: "",
    defText: "none",
    rangeText: "a file",
    unit: "text",
    doc: "the agent's credentials for the shared registries, a docker `config.json` style file",
  },
  {
    env: "SANDBOXD_INSECURE_REGISTRIES",
    flag: "insecure-registries",
    scope: "agent",
    reported: false,
    def: "",
    defText: "none (loopback only)",
    rangeText: "host[:port],...",
    unit: "text",
    check: (v) => refusal(() => parseRegistryList(v, "an entry")),
    doc: "registries besides loopback ones that bakes speak plain HTTP to",
  },
  {
    env: "SANDBOXD_PULL_MAX_BYTES",
    emptyIsUnset: true,
    flag: "pull-max-bytes",
    scope: "agent",
    reported: false,
    def: DEFAULT_MAX_PULL_BYTES,
    min: 0,
    max: MAX_BYTES,
    unit: "bytes",
    doc: "the largest image a registry pull copies, as its manifest declares it",
  },
  {
    env: "SANDBOXD_IMAGE_CACHE_BYTES",
    emptyIsUnset: true,
    flag: "image-cache-bytes",
    scope: "agent",
    reported: false,
    def: DEFAULT_IMAGE_CACHE_BYTES,
    min: 0,
    max: MAX_BYTES,
    unit: "bytes",
    doc: "the image caches are evicted least recently used down to this",
  },
  {
    env: "SANDBOXD_DISK_RESERVE_BYTES",
    emptyIsUnset: true,
    flag: "disk-reserve-bytes",
    scope: "agent",
    reported: false,
    def: DEFAULT_DISK_RESERVE_BYTES,
    min: 0,
    max: MAX_BYTES,
    unit: "bytes",
    doc: "uploads, pulls, imports, suspends and template builds keep this much disk and tmpfs free, else answer 507 insufficient_storage",
  },
  {
    env: "SANDBOXD_VM_MEMORY_BYTES",
    emptyIsUnset: true,
    flag: "vm-memory-bytes",
    scope: "agent",
    def: 0,
    min: 0,
    max: MAX_BYTES,
    unit: "bytes",
    doc: "host memory the VMs may hold together (guest RAM, QEMU's overhead and translation cache per VM, RAM files on tmpfs): admission refuses past it with 503 at_capacity, and the VMs' common cgroup is limited to it; 0 is 75% of host memory",
  },
  {
    env: "SANDBOXD_PRELAUNCH",
    flag: "prelaunch",
    scope: "agent",
    reported: false,
    def: 1,
    min: 0,
    max: MAX_PRELAUNCH_PER_TEMPLATE,
    unit: "count",
    doc: "QEMUs kept launched in their jail per template, waiting for a create; 0 turns it off",
  },
  {
    env: "SANDBOXD_ACCEL",
    emptyIsUnset: true,
    flag: "accel",
    scope: "agent",
    reported: false,
    def: "auto",
    choices: ["auto", "kvm", "tcg"],
    unit: "choice",
    doc: "the accelerator: auto probes /dev/kvm (KVM when usable, else TCG); kvm or tcg skip the probe",
  },
  {
    env: "SANDBOXD_JAIL_UID_BASE",
    emptyIsUnset: true,
    flag: "jail-uid-base",
    scope: "agent",
    reported: false,
    def: DEFAULT_UID_RANGE.base,
    min: 1,
    // uid_t is 32 bits and (uid_t)-1 means "no change": the range must end below it.
    max: 2 ** 32 - 2,
    unit: "count",
    doc: "the first uid/gid of the jails' range (one per live VM)",
  },
  {
    env: "SANDBOXD_JAIL_UID_COUNT",
    emptyIsUnset: true,
    flag: "jail-uid-count",
    scope: "agent",
    reported: false,
    def: DEFAULT_UID_RANGE.count,
    // 0 is accepted so that a jail refuses to start naming the empty range (doctor checks it).
    min: 0,
    max: 2 ** 32 - 2,
    unit: "count",
    doc: "how many uids the jails' range holds: the most VMs alive at once",
  },
  {
    env: "SANDBOXD_JAIL_UNSHARE",
    flag: "jail-unshare",
    scope: "agent",
    reported: false,
    def: "",
    defText: "util-linux's unshare",
    rangeText: "a file",
    unit: "text",
    doc: "the `unshare` binary the jail runs",
  },
  {
    env: "SANDBOXD_KSM",
    emptyIsUnset: true,
    flag: "ksm",
    scope: "agent",
    reported: false,
    def: "off",
    choices: ["off", "qemu"],
    unit: "choice",
    doc: "qemu: each sandbox's QEMU offers its own memory, never guest RAM, to KSM (the host must run KSM: /sys/kernel/mm/ksm/run); docs/isolation.md",
  },
  {
    env: "SANDBOXD_DEBIAN_MIRROR",
    flag: "debian-mirror",
    scope: "agent",
    reported: false,
    def: "",
    defText: "the host's apt sources' Debian mirror",
    rangeText: "a URL",
    unit: "text",
    doc: "where the catalog templates' debootstrap fetches Debian",
  },
  // The CLI process's own output.
  {
    env: "SANDBOXD_QUIET",
    emptyIsUnset: true,
    scope: "cli",
    reported: false,
    def: "0",
    choices: ["0", "1"],
    unit: "choice",
    doc: "1: the `sandboxd: ...` log lines on stderr are not written",
  },
  {
    env: HEAP_STATS_ENV,
    emptyIsUnset: true,
    scope: "cli",
    reported: false,
    def: "0",
    choices: ["0", "1"],
    unit: "choice",
    doc: "1: `up` writes its heap statistics to stderr on SIGUSR2",
  },
];

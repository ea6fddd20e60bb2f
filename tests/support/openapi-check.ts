/**
 * Checks responses against openapi.yaml (test code only): for (method, concrete path, status) it
 * finds the operation by path template, requires the status to be documented for it, the content
 * type to be one the operation documents for that status (or no body where none is documented),
 * and a JSON body to validate against the response schema. Schemas are the document's
 * `components.schemas`, compiled with Ajv's JSON Schema 2020-12 dialect (what OpenAPI 3.1 uses)
 * plus ajv-formats (`date-time`, ...).
 *
 * A path the document does not describe may only answer with the error envelope (the gateway's
 * 404 for unknown routes); anything else there is reported as undocumented.
 *
 * Hooked into the e2e typed fetch (tests/support/e2e-service.ts) and the gateway harness
 * (tests/support/gateway-harness.ts): every response those tests see goes through `assertResponse`.
 */
import { readFileSync } from "node:fs";
import Ajv2020, { type ErrorObject, type ValidateFunction } from "ajv/dist/2020.js";
import addFormats from "ajv-formats";
import { parse } from "yaml";
import { OPENAPI_PATH } from "../../gateway/openapi.ts";

type Json = Record<string, unknown>;

interface MediaType {
  schema?: Json;
}
interface ResponseObject {
  $ref?: string;
  content?: Record<string, MediaType>;
}
interface Operation {
  operationId?: string;
  responses: Record<string, ResponseObject>;
}
interface OpenApiDoc {
  paths: Record<string, Record<string, Operation>>;
  components: { schemas: Record<string, Json>; responses: Record<string, ResponseObject> };
}

export interface CheckedResponse {
  method: string;
  /** Concrete request path (a query string is ignored). */
  path: string;
  status: number;
  /** The Content-Type header, if any. */
  contentType: string | null;
  /** The body as text ("" when there is none). */
  text: string;
}

const SCHEMA_URN = "urn:sandboxd:schema:";

/** `#/components/schemas/X` -> the id under which X is registered with Ajv. */
function rewriteRefs<T>(schema: T): T {
  return JSON.parse(JSON.stringify(schema).replaceAll('"#/components/schemas/', `"${SCHEMA_URN}`)) as T;
}

function mediaBase(ct: string): string {
  return ct.split(";")[0]!.trim().toLowerCase();
}

export class OpenApiChecker {
  private readonly doc: OpenApiDoc;
  private readonly ajv: Ajv2020;
  private readonly compiled = new Map<string, ValidateFunction>();
  private readonly templates: { template: string; re: RegExp; literal: number }[];

  constructor(yamlText: string) {
    this.doc = parse(yamlText) as OpenApiDoc;
    this.ajv = new Ajv2020({ allErrors: true, strict: false });
    addFormats(this.ajv);
    for (const [name, schema] of Object.entries(this.doc.components.schemas)) {
      this.ajv.addSchema({ ...rewriteRefs(schema), $id: `${SCHEMA_URN}${name}` });
    }
    this.templates = Object.keys(this.doc.paths).map((template) => ({
      template,
      re: new RegExp(`^${template.replace(/\{[^}]+\}/g, "[^/]+")}$`),
      // More literal characters = more specific template (a literal path beats `{id}`).
      literal: template.replace(/\{[^}]+\}/g, "").length,
    }));
  }

  /** The path template describing `path`, if any (the most specific one). */
  templateOf(path: string): string | undefined {
    const p = path.split("?")[0]!;
    return this.templates
      .filter((t) => t.re.test(p))
      .sort((a, b) => b.literal - a.literal)
      .at(0)?.template;
  }

  private validator(key: string, schema: Json): ValidateFunction {
    let v = this.compiled.get(key);
    if (!v) {
      v = this.ajv.compile(rewriteRefs(schema));
      this.compiled.set(key, v);
    }
    return v;
  }

  private resolveResponse(r: ResponseObject): ResponseObject {
    const ref = r.$ref;
    if (ref === undefined) return r;
    const name = ref.replace("#/components/responses/", "");
    const target = this.doc.components.responses[name];
    if (!target) throw new Error(`openapi.yaml: unresolved ${ref}`);
    return target;
  }

  /** Problems with one response; empty when it conforms. */
  check(r: CheckedResponse): string[] {
    const method = r.method.toLowerCase();
    const template = this.templateOf(r.path);
    const op = template !== undefined ? this.doc.paths[template]?.[method] : undefined;
    if (!op || template === undefined) {
      // Not an API operation: only the error envelope is acceptable (unknown route / method).
      if (r.status < 400) return [`${method.toUpperCase()} ${r.path} is not documented in openapi.yaml`];
      return this.checkBody(r, "Error", { content: this.doc.components.responses.Error?.content ?? {} });
    }
    const documented = op.responses[String(r.status)] ?? op.responses.default;
    if (!documented) {
      return [
        `status ${r.status} is not documented for ${method.toUpperCase()} ${template} (documented: ${Object.keys(op.responses).join(", ")})`,
      ];
    }
    return this.checkBody(r, `${method} ${template} ${r.status}`, this.resolveResponse(documented));
  }

  private checkBody(r: CheckedResponse, key: string, resp: ResponseObject): string[] {
    const content = resp.content;
    if (!content || Object.keys(content).length === 0) {
      return r.text.length === 0 ? [] : [`no body is documented, got ${r.text.length} bytes`];
    }
    if (r.contentType === null) return [`no Content-Type; documented: ${Object.keys(content).join(", ")}`];
    const base = mediaBase(r.contentType);
    const mt = Object.entries(content).find(([k]) => mediaBase(k) === base);
    if (!mt) return [`Content-Type ${r.contentType} is not documented (${Object.keys(content).join(", ")})`];
    const [mediaType, { schema }] = mt;
    if (mediaBase(mediaType) !== "application/json" || schema === undefined) return [];
    let body: unknown;
    try {
      body = JSON.parse(r.text);
    } catch (err) {
      return [`body is not JSON: ${(err as Error).message}`];
    }
    const validate = this.validator(key, schema);
    if (validate(body)) return [];
    return (validate.errors ?? []).map(formatError);
  }
}

function formatError(e: ErrorObject): string {
  return `${e.instancePath || "(body)"} ${e.message ?? e.keyword} ${JSON.stringify(e.params)}`;
}

let shared: OpenApiChecker | undefined;

/** The checker for the committed openapi.yaml (loaded once). */
export function openApiChecker(): OpenApiChecker {
  shared ??= new OpenApiChecker(readFileSync(OPENAPI_PATH, "utf8"));
  return shared;
}

/** Throws (path, status, validator errors, body excerpt) when `r` does not conform. */
export function assertResponse(r: CheckedResponse): void {
  const problems = openApiChecker().check(r);
  if (problems.length === 0) return;
  throw new Error(
    `response does not match openapi.yaml: ${r.method.toUpperCase()} ${r.path} -> ${r.status}\n  ${problems.join("\n  ")}\n  body: ${r.text.slice(0, 500)}`,
  );
}

/** Checks a fetch Response without consuming it (reads a clone). */
export async function assertFetchResponse(method: string, path: string, res: Response): Promise<void> {
  const text = res.status === 101 || res.body === null ? "" : await res.clone().text();
  assertResponse({ method, path, status: res.status, contentType: res.headers.get("content-type"), text });
}

/**
 * Where the committed openapi.yaml lives: beside the code, one directory up. Its own small module
 * so the route that serves it does not pull the generator (gateway/openapi.ts) into the gateway;
 * `import.meta.dirname` (not Bun's `import.meta.dir`) because the gateway also runs under Node
 * and Deno.
 */
import { join } from "node:path";

export const OPENAPI_PATH = join(import.meta.dirname, "..", "openapi.yaml");

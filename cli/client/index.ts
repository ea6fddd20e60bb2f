/**
 * `sandboxd sbx ...` and `sandboxd template ...`: the client commands, which talk to any sandboxd
 * server through the TypeScript SDK (sdk/typescript). This module parses, dispatches and turns
 * failures into exit codes: 2 for a command line the parser refuses (a short message and where
 * the help is), 1 for a refusal from the server (`code: message`, the API's error envelope) or a
 * server that cannot be reached, else what the command returns (`exec` returns the command's
 * exit code). Help and usage errors never load the SDK or touch the network.
 */
import { helpText, parseCommand, UsageError } from "./args.ts";
import type { Ctx } from "./context.ts";
import { GROUPS, type Group, groupHelp } from "./specs.ts";

export async function runClient(group: Group, args: string[], ctx: Ctx): Promise<number> {
  const [sub, ...rest] = args;
  if (sub === undefined || sub === "help" || sub === "--help" || sub === "-h") {
    (sub === undefined ? ctx.stderr : ctx.stdout).write(`${groupHelp(group)}\n`);
    return sub === undefined ? 2 : 0;
  }
  const specs: Record<string, (typeof GROUPS)[Group]["specs"][string]> = GROUPS[group].specs;
  const spec = specs[sub];
  try {
    if (!spec) throw new UsageError(`unknown command ${group} ${sub}`, group);
    const parsed = parseCommand(spec, rest);
    if (parsed.help) {
      ctx.stdout.write(`${helpText(spec)}\n`);
      return 0;
    }
    const handlers =
      group === "sbx" ? (await import("./sbx.ts")).SBX : (await import("./template.ts")).TEMPLATE;
    const handler = handlers[sub];
    if (!handler) throw new UsageError(`unknown command ${group} ${sub}`, group);
    return await handler(parsed, spec, ctx);
  } catch (err) {
    if (err instanceof UsageError) {
      ctx.stderr.write(`sandboxd ${err.command}: ${err.message} (see sandboxd ${err.command} --help)\n`);
      return 2;
    }
    const { errorLine } = await import("./errors.ts");
    ctx.stderr.write(`${errorLine(err)}\n`);
    return 1;
  }
}

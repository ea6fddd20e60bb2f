/**
 * Building DOM without HTML strings: every value from the API becomes a text node or an
 * attribute set by name, never markup (no innerHTML anywhere in the console), so a label such as
 * `<img src=x onerror=...>` shows as those characters.
 */

/**
 * Attributes `el` may set: a fixed list, so no `on*` handler or `href`/`src` comes from data
 * (`value` is an `<option>`'s: text the page reads back, never a URL or code).
 */
const ATTRS = new Set(["class", "id", "type", "title", "role", "colspan", "aria-label", "value"]);

/**
 * `el("td", { class: "id", dataset: { id } }, "text", child)`: children are nodes or strings
 * (strings become text nodes); `null`/`undefined` children are skipped.
 */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "dataset") {
      for (const [k, v] of Object.entries(value)) node.dataset[k] = String(v);
    } else if (ATTRS.has(name)) {
      node.setAttribute(name, String(value));
    } else {
      throw new Error(`el: attribute ${name} is not allowed`);
    }
  }
  append(node, children);
  return node;
}

export function append(node, children) {
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
}

/** Replaces every child of `node` with `children`. */
export function replace(node, ...children) {
  node.replaceChildren();
  append(node, children);
}

/** An SVG element (the usage chart), attributes set by name: numbers and fixed strings only. */
export function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name.startsWith("on")) throw new Error(`svg: attribute ${name} is not allowed`);
    node.setAttribute(name, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

export function $(id) {
  const node = document.getElementById(id);
  if (!node) throw new Error(`no element #${id}`);
  return node;
}

/** "3 s", "4 min", "2 h", "5 d": an age at a glance. */
export function age(secs) {
  if (secs < 60) return `${Math.floor(secs)} s`;
  if (secs < 3600) return `${Math.floor(secs / 60)} min`;
  if (secs < 86400) return `${Math.floor(secs / 3600)} h`;
  return `${Math.floor(secs / 86400)} d`;
}

/** A duration in ms as "850 ms" or "3.4 s". */
export function ms(v) {
  return v < 1000 ? `${Math.round(v)} ms` : `${(v / 1000).toFixed(1)} s`;
}

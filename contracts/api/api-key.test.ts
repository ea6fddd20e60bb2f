import { describe, expect, test } from "bun:test";
import { apiKeyPrefix, keyIdOfPrefix, MAX_API_KEY_CHARS, parseApiKey, presentedKey } from "./api-key.ts";

const ID = "abcdefghij12";
const SECRET = "0123456789abcdefABCDEF0123456789abcdefAB";

describe("parseApiKey", () => {
  test("a key without a region: four segments, as issued before regions", () => {
    expect(parseApiKey(`svc_pro_${ID}_${SECRET}`)).toEqual({ tier: "pro", keyId: ID, secret: SECRET });
  });

  test("the region is whatever lies between the tier and the id, `_`, `.` and `-` included", () => {
    for (const region of ["eu", "us-east-1", "eu_west", "a_b_c", "ap.south_2-x", "R".repeat(64)]) {
      expect(parseApiKey(`svc_enterprise_${region}_${ID}_${SECRET}`)).toEqual({
        tier: "enterprise",
        keyId: ID,
        secret: SECRET,
        region,
      });
    }
  });

  test("what is not a key", () => {
    const bad = [
      "",
      `svc_pro_${ID}`,
      `sv_pro_${ID}_${SECRET}`,
      `svc_gold_${ID}_${SECRET}`, // no such tier
      `svc_pro_${ID.toUpperCase()}_${SECRET}`, // the id is lowercase
      `svc_pro_abc_${SECRET}`, // id too short
      `svc_pro_${ID}_short`, // secret too short
      `svc_pro__${ID}_${SECRET}`, // an empty region
      `svc_pro_eu/west_${ID}_${SECRET}`, // a character no region has
      `svc_pro_${"r".repeat(65)}_${ID}_${SECRET}`, // a region too long
      `svc_pro_${ID}_${SECRET}_`, // an empty secret
    ];
    for (const k of bad) expect(parseApiKey(k)).toBeNull();
  });

  test("the longest key parses; one character more is refused before it is split", () => {
    const longest = `svc_enterprise_${"r".repeat(64)}_${"i".repeat(32)}_${"s".repeat(128)}`;
    expect(longest.length).toBe(MAX_API_KEY_CHARS);
    expect(parseApiKey(longest)?.region).toBe("r".repeat(64));
    expect(parseApiKey(`${longest}s`)).toBeNull();
  });

  test("the prefix is the key without its secret, and names the id last", () => {
    expect(apiKeyPrefix({ tier: "pro", keyId: ID })).toBe(`svc_pro_${ID}`);
    expect(apiKeyPrefix({ tier: "pro", keyId: ID, region: null })).toBe(`svc_pro_${ID}`);
    expect(apiKeyPrefix({ tier: "pro", keyId: ID, region: "eu_w" })).toBe(`svc_pro_eu_w_${ID}`);
    expect(keyIdOfPrefix(`svc_pro_eu_w_${ID}`)).toBe(ID);
    expect(keyIdOfPrefix(`svc_pro_${ID}`)).toBe(ID);
  });
});

describe("presentedKey", () => {
  const of = (h: Record<string, string>) => presentedKey((name) => h[name]);
  test("Bearer, any case of the scheme; a malformed Authorization presents none", () => {
    expect(of({ authorization: "Bearer k1" })).toBe("k1");
    expect(of({ authorization: "bearer   k1  " })).toBe("k1");
    expect(of({ authorization: "Basic k1" })).toBeUndefined();
    expect(of({})).toBeUndefined();
  });
  test("a WebSocket upgrade's key subprotocol, only without Authorization", () => {
    const ws = { upgrade: "websocket", "sec-websocket-protocol": "sandboxd, sandboxd.key.k2" };
    expect(of(ws)).toBe("k2");
    expect(of({ ...ws, authorization: "Bearer k1" })).toBe("k1");
    expect(of({ ...ws, authorization: "Token k1" })).toBeUndefined();
  });
});

/*
 * The wire codec: little-endian integers, TLV records (built and parsed), frames (the header of
 * each outgoing frame, the incremental decoder of incoming ones). The numbers are in protocol.h,
 * the prose in docs/guest-protocol.md "Framing".
 */
#include "agent.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* little-endian integers */

static void put16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t get64(const uint8_t *p) {
  return (uint64_t)get32(p) | ((uint64_t)get32(p + 4) << 32);
}

/* ------------------------------------------------------------------------------------------ */
/* growable byte buffer (struct buf: agent.h) */

int buf_reserve(struct buf *b, size_t extra) {
  if (b->failed) return -1;
  if (b->len + extra <= b->cap) return 0;
  size_t nc = b->cap ? b->cap : 256;
  while (nc < b->len + extra) nc *= 2;
  uint8_t *np = realloc(b->p, nc);
  if (!np) {
    b->failed = 1;
    return -1;
  }
  b->p = np;
  b->cap = nc;
  return 0;
}
static void buf_put(struct buf *b, const void *d, size_t n) {
  if (n == 0 || buf_reserve(b, n) < 0) return;
  memcpy(b->p + b->len, d, n);
  b->len += n;
}
void buf_free(struct buf *b) {
  free(b->p);
  memset(b, 0, sizeof *b);
}

/* ------------------------------------------------------------------------------------------ */
/* TLV records: u16 tag, u32 len, value (docs "Framing") */

void tlv_put(struct buf *b, uint16_t tag, const void *v, size_t n) {
  uint8_t h[6];
  put16(h, tag);
  put32(h + 2, (uint32_t)n);
  buf_put(b, h, 6);
  buf_put(b, v, n);
}
void tlv_u32(struct buf *b, uint16_t tag, uint32_t v) {
  uint8_t x[4];
  put32(x, v);
  tlv_put(b, tag, x, 4);
}
void tlv_u64(struct buf *b, uint16_t tag, uint64_t v) {
  uint8_t x[8];
  put64(x, v);
  tlv_put(b, tag, x, 8);
}
void tlv_str(struct buf *b, uint16_t tag, const char *s) { tlv_put(b, tag, s, strlen(s)); }

/* Next record at *off: 1 found, 0 end of list, -1 malformed (length past the payload). */
int tlv_next(const uint8_t *p, size_t n, size_t *off, struct tlv *t) {
  if (*off == n) return 0;
  if (n - *off < 6) return -1;
  t->tag = get16(p + *off);
  t->len = get32(p + *off + 2);
  if (t->len > n - *off - 6) return -1;
  t->v = p + *off + 6;
  *off += 6 + (size_t)t->len;
  return 1;
}
int tlv_valid(const uint8_t *p, size_t n) {
  size_t off = 0;
  struct tlv t;
  int r;
  while ((r = tlv_next(p, n, &off, &t)) == 1) {
  }
  return r == 0;
}
/* First record with `tag`; unknown tags are simply never asked for (docs: skipped). */
int tlv_find(const uint8_t *p, size_t n, uint16_t tag, struct tlv *out) {
  size_t off = 0;
  struct tlv t;
  while (tlv_next(p, n, &off, &t) == 1)
    if (t.tag == tag) {
      *out = t;
      return 1;
    }
  return 0;
}
/* 1 found, 0 absent, -1 present with the wrong width. */
int tlv_get_u32(const uint8_t *p, size_t n, uint16_t tag, uint32_t *v) {
  struct tlv t;
  if (!tlv_find(p, n, tag, &t)) return 0;
  if (t.len != 4) return -1;
  *v = get32(t.v);
  return 1;
}
int tlv_get_u64(const uint8_t *p, size_t n, uint16_t tag, uint64_t *v) {
  struct tlv t;
  if (!tlv_find(p, n, tag, &t)) return 0;
  if (t.len != 8) return -1;
  *v = get64(t.v);
  return 1;
}
/* NUL-terminated copy of a string record (a value with an embedded NUL ends there). */
char *tlv_strdup(const struct tlv *t) { return strndup((const char *)t->v, t->len); }

/* ------------------------------------------------------------------------------------------ */
/* frames */

/* Frame header: u16 magic, u8 version, u8 type, u32 stream, u32 payload length. */
void frame_header(uint8_t *h, uint8_t type, uint32_t stream, uint32_t len) {
  put16(h, SBX_MAGIC);
  h[2] = SBX_VERSION;
  h[3] = type;
  put32(h + 4, stream);
  put32(h + 8, len);
}

/* ------------------------------------------------------------------------------------------ */
/* incremental frame decoder (host -> guest) */

static uint8_t hdr[SBX_HEADER_LEN];
static size_t hdr_len;
static uint8_t frame_payload[SBX_MAX_PAYLOAD]; /* one frame at a time; static: no allocation */
static size_t pay_len, pay_need;
static int in_payload;
/* After a malformed header we skip input until something that looks like a HELLO header:
 * the host sends HELLO to resynchronise (docs "Framing"). */
static int resync;

void decoder_reset(void) {
  hdr_len = 0;
  pay_len = pay_need = 0;
  in_payload = 0;
  resync = 0;
}

/* Whether the first n bytes can start a valid header (in resync: a HELLO header). */
static int hdr_prefix_ok(const uint8_t *h, size_t n, int want_hello) {
  if (n > 0 && h[0] != (SBX_MAGIC & 0xff)) return 0;
  if (n > 1 && h[1] != (SBX_MAGIC >> 8)) return 0;
  if (n > 2 && h[2] != SBX_VERSION) return 0;
  if (want_hello) {
    if (n > 3 && h[3] != SBX_T_HELLO) return 0;
    for (size_t i = 4; i < 8 && i < n; i++)
      if (h[i]) return 0;
  }
  if (n >= SBX_HEADER_LEN && get32(h + 8) > SBX_MAX_PAYLOAD) return 0;
  return 1;
}

void feed(const uint8_t *p, size_t n) {
  while (n > 0 && connected) { /* a dispatch may lose the host: stop feeding then */
    if (!in_payload) {
      hdr[hdr_len++] = *p++;
      n--;
      if (!hdr_prefix_ok(hdr, hdr_len, resync)) {
        if (!resync) {
          logmsg("malformed frame header (magic/version/length), dropping input until HELLO");
          resync = 1;
        }
        size_t k = 1;
        while (k < hdr_len && !hdr_prefix_ok(hdr + k, hdr_len - k, 1)) k++;
        memmove(hdr, hdr + k, hdr_len - k);
        hdr_len -= k;
        continue;
      }
      if (hdr_len == SBX_HEADER_LEN) {
        uint8_t type = hdr[3];
        uint32_t stream = get32(hdr + 4);
        pay_need = get32(hdr + 8);
        pay_len = 0;
        hdr_len = 0;
        if (type == SBX_T_HELLO) resync = 0;
        if (pay_need == 0) {
          dispatch(type, stream, frame_payload, 0);
        } else {
          in_payload = 1;
          hdr[3] = type; /* keep type/stream for when the payload completes */
          put32(hdr + 4, stream);
        }
      }
      continue;
    }
    size_t take = pay_need - pay_len;
    if (take > n) take = n;
    memcpy(frame_payload + pay_len, p, take);
    pay_len += take;
    p += take;
    n -= take;
    if (pay_len == pay_need) {
      in_payload = 0;
      dispatch(hdr[3], get32(hdr + 4), frame_payload, pay_len);
    }
  }
}

/*
 * Tunnels (OP CONNECT): a raw byte duplex between the host and a TCP socket in the guest.
 *
 * After a successful RESPONSE the stream carries DATA both ways. Each direction has credit
 * (SBX_TUNNEL_WINDOW bytes to start): we read the socket only while the host has granted us
 * room, and grant the host CREDIT only for bytes already written into the socket. So what a
 * tunnel can hold in PID 1 is bounded by one window per direction, whatever the speed of either
 * end, and a slow reader on either side exerts back-pressure all the way to the writer.
 *
 * Closing (docs "Tunnels"): there is no half-close. EOF or an error on the socket sends CLOSE
 * (after the DATA already read; an error rides in the CLOSE as STATUS/ERROR) and frees the
 * tunnel. A CLOSE from the host stops reading, writes what the host already sent into the socket
 * (at most TUNNEL_LINGER_MS), closes it and answers CLOSE: the host sees exactly one CLOSE per
 * tunnel from us, after which its stream id is free again. Frames for unknown streams are
 * dropped: they cross a CLOSE in flight.
 *
 * The egress proxy (egress.c) opens tunnels of the same kind from the guest side.
 */
#include "agent.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* A CONNECT still in progress after this long fails with ETIMEDOUT. Loopback connects finish at
 * once (or are refused at once); the bound is for a HOST that silently drops SYNs, where the
 * kernel's own retry schedule would take minutes while the host caller waits. */
#define TUNNEL_CONNECT_MS 10000
/* After the host's CLOSE we still write what it sent before (the request before a hang-up). A
 * guest reader that never drains must not hold the socket and its queue for ever: 5 s. */
#define TUNNEL_LINGER_MS 5000
/* CREDIT is granted in batches of at least this many bytes (or when the queue empties), so a
 * stream of small socket writes does not answer every DATA frame with a CREDIT frame. */
#define TUNNEL_GRANT_BATCH (SBX_TUNNEL_WINDOW / 4)

struct tunnel *tunnels;
int n_tunnels;      /* live ones (the MAX_TUNNELS bound) */
int n_tunnel_slots; /* structs in the list, dead ones included (poll set size) */

struct tunnel *find_tunnel(uint32_t stream) {
  for (struct tunnel *t = tunnels; t; t = t->next)
    if (t->stream == stream && !t->dead) return t;
  return NULL;
}

/* A new tunnel (CONNECT or egress) joins the list the loop polls. */
void tunnel_link(struct tunnel *t) {
  t->next = tunnels;
  tunnels = t;
  n_tunnels++;
  n_tunnel_slots++;
}

/* Ends a tunnel: the socket is closed now, the struct is freed by tunnels_sweep (a poll pass may
 * still hold a pointer to it). `send_close`: tell the host (err 0 = clean EOF). */
void tunnel_end(struct tunnel *t, int send_close, int err, const char *what) {
  if (t->dead) return;
  t->dead = 1;
  n_tunnels--;
  if (t->fd >= 0) close(t->fd);
  t->fd = -1;
  pty_hangup(t); /* a PTY's shell goes with its terminal */
  chunkq_clear(&t->in);
  if (!send_close) return;
  if (!err) {
    send_frame(SBX_T_CLOSE, t->stream, NULL, 0);
    return;
  }
  char msg[200];
  snprintf(msg, sizeof msg, "tunnel %s: %s", what, strerror(err));
  struct buf b = {0};
  tlv_u32(&b, SBX_TAG_STATUS, (uint32_t)err);
  tlv_str(&b, SBX_TAG_ERROR, msg);
  send_buf(SBX_T_CLOSE, t->stream, &b);
  buf_free(&b);
}

/* The host is gone (disconnect) or starts afresh (HELLO): its tunnel state is gone, so ours goes
 * too, without frames. This is also what keeps a snapshot-restored fork child from inheriting
 * its parent's tunnels: its host reconnects and sends HELLO before anything else. */
void tunnels_close_all(const char *why) {
  int n = 0;
  for (struct tunnel *t = tunnels; t; t = t->next)
    if (!t->dead) {
      tunnel_end(t, 0, 0, NULL);
      n++;
    }
  if (n) logmsg("%d tunnel(s) closed: %s", n, why);
}

void tunnels_sweep(void) {
  struct tunnel **pp = &tunnels;
  while (*pp) { /* bounded by MAX_TUNNELS plus those ended since the last sweep */
    struct tunnel *t = *pp;
    if (t->dead) {
      *pp = t->next;
      n_tunnel_slots--;
      free(t);
      continue;
    }
    pp = &t->next;
  }
}

static void tunnel_grant(struct tunnel *t, int force) {
  if (t->dead || t->host_closed || t->grant == 0) return;
  if (!force && t->grant < TUNNEL_GRANT_BATCH) return;
  uint8_t v[4];
  put32(v, t->grant);
  send_frame(SBX_T_CREDIT, t->stream, v, 4);
  t->recv_credit += t->grant;
  t->grant = 0;
}

/* Writes queued host data into the socket without blocking; grants CREDIT for what went in. */
void tunnel_pump(struct tunnel *t) {
  while (!t->dead && t->in.head) { /* ends at EAGAIN or an empty queue (<= one window) */
    struct chunk *c = t->in.head;
    ssize_t n = write(t->fd, c->data + c->off, c->len - c->off);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) break;
      tunnel_end(t, 1, errno, "write"); /* EPIPE/ECONNRESET: the guest side is gone */
      return;
    }
    t->grant += (uint32_t)n;
    chunkq_consumed(&t->in, (size_t)n);
  }
  if (t->dead) return;
  if (t->host_closed && !t->in.head) {
    tunnel_end(t, 1, 0, NULL); /* flushed: close and answer the host's CLOSE */
    return;
  }
  tunnel_grant(t, t->in.head == NULL);
}

/* Reads the socket while the host has credit; at most READ_PASS_MAX per wakeup (fairness). */
void tunnel_read(struct tunnel *t) {
  size_t done = 0;
  while (!t->dead && !t->host_closed && t->send_credit > 0 && done < READ_PASS_MAX) {
    size_t want = t->send_credit < sizeof scratch ? t->send_credit : sizeof scratch;
    ssize_t n = read(t->fd, scratch, want);
    if (n > 0) {
      send_frame(SBX_T_DATA, t->stream, scratch, (size_t)n);
      t->send_credit -= (uint32_t)n;
      done += (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    /* EOF or an error: what the peer sent before is already queued to the host, ahead of the
     * CLOSE. Host data not yet written is dropped with the socket (no half-close, see above). */
    int err = n < 0 ? errno : 0;
    if (err == EIO && t->pty_pid) err = 0; /* a PTY master's EOF: the shell side closed */
    tunnel_end(t, 1, err, "read");
    return;
  }
}

/* The non-blocking connect finished (POLLOUT/POLLERR) or timed out. */
void tunnel_connected(struct tunnel *t, int timed_out) {
  int err = 0;
  socklen_t len = sizeof err;
  if (timed_out)
    err = ETIMEDOUT;
  else if (getsockopt(t->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
    err = errno;
  t->connecting = 0;
  if (err) {
    respond_errno(t->stream, err, "connect", NULL);
    tunnel_end(t, 0, 0, NULL); /* the RESPONSE was the stream's final answer */
    return;
  }
  t->send_credit = t->recv_credit = SBX_TUNNEL_WINDOW;
  respond_status(t->stream, 0, NULL);
}

void op_connect(uint32_t stream, const uint8_t *p, size_t n) {
  if (n_tunnels >= MAX_TUNNELS) {
    respond_status(stream, EAGAIN, "connect: too many tunnels");
    return;
  }
  if (find_tunnel(stream) || find_exec(stream)) {
    respond_status(stream, EEXIST, "connect: stream id already in use");
    return;
  }
  uint32_t port = 0;
  if (tlv_get_u32(p, n, SBX_TAG_PORT, &port) != 1 || port == 0 || port > 65535) {
    respond_status(stream, EINVAL, "connect: PORT missing or not in 1..65535");
    return;
  }
  char host[64] = "127.0.0.1";
  struct tlv t;
  if (tlv_find(p, n, SBX_TAG_HOST, &t)) {
    if (t.len == 0 || t.len >= sizeof host) {
      respond_status(stream, EINVAL, "connect: HOST is not an IP address");
      return;
    }
    memcpy(host, t.v, t.len);
    host[t.len] = 0;
  }
  struct sockaddr_storage ss;
  memset(&ss, 0, sizeof ss);
  socklen_t sl;
  struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
  struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
  if (inet_pton(AF_INET, host, &s4->sin_addr) == 1) {
    s4->sin_family = AF_INET;
    s4->sin_port = htons((uint16_t)port);
    sl = sizeof *s4;
  } else if (inet_pton(AF_INET6, host, &s6->sin6_addr) == 1) {
    s6->sin6_family = AF_INET6;
    s6->sin6_port = htons((uint16_t)port);
    sl = sizeof *s6;
  } else {
    respond_status(stream, EINVAL, "connect: HOST is not an IP address");
    return;
  }
  int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    respond_errno(stream, errno, "connect: socket", NULL);
    return;
  }
  struct tunnel *tn = calloc(1, sizeof *tn);
  if (!tn) {
    close(fd);
    respond_status(stream, ENOMEM, "connect: out of memory");
    return;
  }
  tn->stream = stream;
  tn->fd = fd;
  tunnel_link(tn);
  if (connect(fd, (struct sockaddr *)&ss, sl) == 0) {
    tunnel_connected(tn, 0);
  } else if (errno == EINPROGRESS || errno == EINTR) {
    tn->connecting = 1; /* POLLOUT tells when it is done */
    tn->connect_deadline_ms = mono_ms() + TUNNEL_CONNECT_MS;
  } else {
    respond_errno(stream, errno, "connect", NULL);
    tunnel_end(tn, 0, 0, NULL);
  }
}

void tunnel_frame(uint8_t type, uint32_t stream, const uint8_t *p, size_t n) {
  struct tunnel *t = find_tunnel(stream);
  /* Unknown (already closed: the frame crossed our CLOSE), or still connecting (the host must
   * wait for the RESPONSE): dropped. */
  if (!t || t->connecting) return;
  switch (type) {
  case SBX_T_DATA: {
    if (t->host_closed || n == 0) return;
    if (n > t->recv_credit) {
      logmsg("tunnel %u: host sent %zu bytes with %u of credit", stream, n, t->recv_credit);
      tunnel_end(t, 1, EPROTO, "credit");
      return;
    }
    if (chunkq_push(&t->in, p, n) < 0) {
      tunnel_end(t, 1, ENOMEM, "queue");
      return;
    }
    t->recv_credit -= (uint32_t)n;
    tunnel_pump(t);
    return;
  }
  case SBX_T_CREDIT: {
    if (n != 4) return;
    uint64_t c64 = (uint64_t)t->send_credit + get32(p);
    /* A correct host only returns what it consumed; never trust more than one window. */
    t->send_credit = c64 > SBX_TUNNEL_WINDOW ? SBX_TUNNEL_WINDOW : (uint32_t)c64;
    return;
  }
  case SBX_T_RESIZE:
    pty_resize(t, p, n);
    return;
  case SBX_T_CLOSE:
    if (t->host_closed) return;
    t->host_closed = 1;
    t->linger_deadline_ms = mono_ms() + TUNNEL_LINGER_MS;
    tunnel_pump(t); /* ends it at once when nothing is queued */
    return;
  }
}

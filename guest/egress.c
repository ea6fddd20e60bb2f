/* Egress (docs "Egress"): the guest has no network interface; its one way out is this proxy port
 * on loopback (every exec gets http_proxy & co. pointing at it). Each connection accepted here
 * becomes a tunnel that WE open: an OPEN frame on a stream id with SBX_GUEST_STREAM_BIT, then
 * DATA/CREDIT/CLOSE exactly as for CONNECT. The host agent reads the proxy request, checks it
 * against the sandbox's allow-list and connects (or refuses) on the host; nothing is decided
 * here. */
#include "agent.h"

#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int egress_fd = -1;
static uint32_t egress_port;
static uint32_t next_guest_stream;

void egress_listen(uint32_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    logmsg("egress socket: %s", strerror(errno));
    return;
  }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  /* Backlog 64: a burst of client connects waits in the kernel while the loop takes them. */
  if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 64) < 0) {
    logmsg("egress listen on 127.0.0.1:%u: %s", port, strerror(errno));
    close(fd);
    return;
  }
  egress_fd = fd;
  egress_port = port;
}

/* Refuses a client at once with a reset (not a silent close), so it fails fast instead of
 * waiting for a proxy answer that will not come. */
static void egress_refuse(int fd) {
  struct linger l = {.l_onoff = 1, .l_linger = 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  close(fd);
}

void egress_accept(void) {
  /* At most 16 per pass: a flood of connects must not starve the port and the execs. */
  for (int i = 0; i < 16; i++) {
    int fd = accept4(egress_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return; /* EAGAIN: none left; other errors (EMFILE...): try next pass */
    if (!connected || n_tunnels >= MAX_TUNNELS) {
      egress_refuse(fd); /* no host to decide, or no room: refused, never left hanging */
      continue;
    }
    struct tunnel *tn = calloc(1, sizeof *tn);
    if (!tn) {
      egress_refuse(fd);
      continue;
    }
    uint32_t stream;
    do /* bounded: at most MAX_TUNNELS ids are taken */
      stream = SBX_GUEST_STREAM_BIT | (next_guest_stream++ & ~SBX_GUEST_STREAM_BIT);
    while (find_tunnel(stream));
    tn->stream = stream;
    tn->fd = fd;
    tn->send_credit = tn->recv_credit = SBX_TUNNEL_WINDOW;
    tunnel_link(tn);
    struct buf b = {0};
    tlv_u32(&b, SBX_TAG_PORT, egress_port);
    send_buf(SBX_T_OPEN, stream, &b);
    buf_free(&b);
  }
}
